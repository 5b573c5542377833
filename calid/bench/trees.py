"""``calid bench lookahead`` and ``calid bench tree``: tree-verified modes side by side.

lookahead: ar vs Lookahead at several decoding lengths vs HF transformers
           prompt lookup decoding (``prompt_lookup_num_tokens``), on summarization
           (XSum, MultiLexSum), HumanEval and MT-bench second turns; no draft model.
tree:      ar vs the best single-chain speculative modes vs token trees
           (LLMCad-style branching where the draft is unsure; SpecInfer-style
           chains merged by common prefix) on the Qwen pair.
Both print tokens/s, ratio to ar, mean EDL (tokens per target forward) and
tree acceptance; lossless modes must agree with ar token for token.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from calid.bench import data
from calid.bench.baselines import add_backend_args
from calid.bench.report import parse_numbers, write_report
from calid.bench.side_by_side import Prompt, run_configs, tabulate
from calid.decoding.modes import DecodeParams

COLUMNS = ["config", "kind", "tok_s", "ratio_vs_ar", "edl", "mean_accepted", "agreement_with_ar", "tokens", "seconds"]
HF_PLD = "HF prompt lookup decoding"


def add_parser(sub) -> None:
    from calid.models.presets import DEFAULT_DRAFT, DEFAULT_TARGET

    la = sub.add_parser("lookahead", help="Lookahead (trie) vs ar vs HF prompt lookup decoding")
    la.add_argument("--target", default=DEFAULT_TARGET)
    la.add_argument("--lengths", default="8,16,32", help="decoding lengths to sweep (tree nodes per step)")
    la.add_argument("--summaries", type=int, default=2, help="XSum and MultiLexSum documents each (default 2)")
    la.add_argument("--doc-tokens", type=int, default=384, help="truncate documents to this many tokens")
    la.add_argument("--code", type=int, default=1, help="HumanEval prompts (default 1)")
    la.add_argument("--mtbench", type=int, default=1, help="MT-bench second turns (default 1)")
    la.add_argument("--max-new-tokens", type=int, default=64)
    la.add_argument("--full", action="store_true", help="20 documents per set, 20 code, 20 MT-bench, 128 tokens")
    la.add_argument("--hf", action="store_true", help="also run HF prompt lookup decoding (dequantized weights)")
    la.add_argument("--out", default="bench_results")
    add_backend_args(la)
    la.set_defaults(func=run_lookahead)

    tr = sub.add_parser("tree", help="token trees vs the best single-chain speculative modes")
    tr.add_argument("--target", default=DEFAULT_TARGET)
    tr.add_argument("--draft", default=DEFAULT_DRAFT)
    tr.add_argument("--code", type=int, default=3, help="HumanEval prompts (default 3)")
    tr.add_argument("--mtbench", type=int, default=1)
    tr.add_argument("--max-new-tokens", type=int, default=96)
    tr.add_argument("--extra-draft", default="self:14",
                    help="second drafter merged into trees for the multi-drafter row (default self:14: the target's "
                         "first 14 of 28 layers); 'none' to skip")
    tr.add_argument("--full", action="store_true", help="40 HumanEval + 20 MT-bench prompts, 256 tokens")
    tr.add_argument("--out", default="bench_results")
    add_backend_args(tr)
    tr.set_defaults(func=run_tree)



def _summary_prompts(tok, n: int, doc_tokens: int, max_new: int) -> list[Prompt]:
    from calid.text import encode_prompt

    out = []
    for kind, ds in (("xsum", data.XSUM), ("multilexsum", data.MULTILEXSUM)):
        for rec in data.summarization(ds, n):
            doc = tok.decode(tok(rec["document"], add_special_tokens=False).input_ids[:doc_tokens])
            out.append(Prompt(kind, encode_prompt(tok, f"Summarize the following document.\n\n{doc}"), max_new))
    return out


def _code_and_chat_prompts(engine, tok, n_code: int, n_mt: int, max_new: int, second_turn: bool) -> list[Prompt]:
    from calid.generation import GenerationRequest, SamplingParams
    from calid.text import encode_prompt

    problems = data.humaneval()[:n_code]
    out = [Prompt("humaneval", encode_prompt(tok, text), max_new, prob)
           for text, prob in zip(data.humaneval_prompts(n_code), problems)]
    for q in data.mtbench_questions()[:n_mt]:
        if not second_turn:
            out.append(Prompt("mtbench", encode_prompt(tok, q["turns"][0]), max_new))
            continue
        first = encode_prompt(tok, q["turns"][0])
        answer = engine.generate([GenerationRequest(first, SamplingParams(max_new_tokens=max_new),
                                                    decode=DecodeParams(mode="ar"))])[0].text
        messages = [{"role": "user", "content": q["turns"][0]}, {"role": "assistant", "content": answer},
                    {"role": "user", "content": q["turns"][1]}]
        out.append(Prompt("mtbench-turn2", encode_prompt(tok, messages), max_new))
    return out


def run_lookahead(args) -> int:
    from transformers import AutoModelForCausalLM

    from calid.backends import open_model
    from calid.decoding.lookahead import LookaheadConfig
    from calid.engine import Engine
    from calid.models.source import resolve

    lengths = parse_numbers(args.lengths, int)
    n_sum, n_code, n_mt, max_new = (20, 20, 20, 128) if args.full else (args.summaries, args.code, args.mtbench,
                                                                         args.max_new_tokens)
    target = open_model(args.target, args.backend, args.dtype)
    engine = Engine.from_models(target, None, max_batch=1, lookahead=LookaheadConfig(decoding_length=max(lengths)))
    tok = target.tokenizer
    prompts = _summary_prompts(tok, n_sum, args.doc_tokens, max_new)
    prompts += _code_and_chat_prompts(engine, tok, n_code, n_mt, max_new, second_turn=True)
    hf = (
        AutoModelForCausalLM.from_pretrained(str(resolve(args.target).path), dtype=torch.float32).eval()
        if args.hf
        else None
    )

    @torch.inference_mode()
    def hf_pld(ids: list[int], n: int) -> list[int]:
        x = torch.tensor([ids])
        out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                          prompt_lookup_num_tokens=10, eos_token_id=sorted(target.eos_ids))
        return out[0, len(ids):].tolist()

    cfgs = [("ar (target only)", DecodeParams(mode="ar"))]
    cfgs += [(f"lookahead L={n}", DecodeParams(mode="lookahead", gamma=n)) for n in lengths]
    if hf is not None:
        cfgs.append((HF_PLD, hf_pld))
    print(
        f"bench lookahead: {target.describe()}; {len(prompts)} prompts ({n_sum} XSum + {n_sum} "
        "MultiLexSum truncated to "
        f"{args.doc_tokens} tokens, {n_code} HumanEval, {n_mt} MT-bench second turns); {max_new} new tokens; greedy",
        file=sys.stderr,
    )
    tallies = run_configs(engine, tok, prompts, cfgs, "bench lookahead")
    rows = _rows_per_kind(cfgs, tallies, prompts, engine, ["xsum", "multilexsum", "humaneval", "mtbench"])
    notes = _lookahead_notes(rows, lengths)
    return _report(args, f"lookahead-{target.name}", "Lookahead vs ar vs HF prompt lookup decoding",
                   {"target": target.name, "prompts": len(prompts), "max_new_tokens": max_new, "batch": 1},
                   rows, notes)


def run_tree(args) -> int:
    from calid.backends import open_model
    from calid.backends import build_engine

    n_code, n_mt, max_new = (40, 20, 256) if args.full else (args.code, args.mtbench, args.max_new_tokens)
    target = open_model(args.target, args.backend, args.dtype)
    engine = build_engine(target, args.draft, args.backend, args.dtype, max_batch=1)
    prompts = _code_and_chat_prompts(engine, target.tokenizer, n_code, n_mt, max_new, second_turn=False)
    cfgs = [("ar (target only)", DecodeParams(mode="ar")),
            ("speculative gamma=4", DecodeParams(mode="speculative", gamma=4, threshold=0.0)),
            ("speculative dynamic gamma<=8 t=0.4", DecodeParams(mode="speculative", gamma=8, threshold=0.4)),
            ("tree gamma=8 width=2 t=0.4", DecodeParams(mode="tree", gamma=8, threshold=0.4, tree_width=2)),
            ("tree gamma=8 width=3 t=0.6", DecodeParams(mode="tree", gamma=8, threshold=0.6, tree_width=3)),
            ("tree 3 chains merged gamma=6", DecodeParams(mode="tree", gamma=6, threshold=0.4, tree_width=1,
                                                          tree_chains=3))]
    print(f"bench tree: target {target.name}, draft {args.draft}; {n_code} HumanEval + {n_mt} MT-bench prompts; "
          f"{max_new} new tokens; greedy", file=sys.stderr)
    tallies = run_configs(engine, target.tokenizer, prompts, cfgs, "bench tree")
    if args.extra_draft != "none":  # SpecInfer with two drafters: the draft model's tree + a self-draft chain
        multi = build_engine(target, args.draft, args.backend, args.dtype, max_batch=1, extra_specs=[args.extra_draft])
        name = f"tree gamma=8 width=2 t=0.4 + {args.extra_draft} chain merged"
        cfgs.append((name, DecodeParams(mode="tree", gamma=8, threshold=0.4, tree_width=2)))
        tallies |= run_configs(multi, target.tokenizer, prompts, cfgs[-1:], "bench tree (two drafters)")
    rows = _rows_per_kind(cfgs, tallies, prompts, engine, ["all"])
    best_chain = max(r["tok_s"] for r in rows if r["config"].startswith("speculative"))
    best_tree = max(r["tok_s"] for r in rows if r["config"].startswith("tree"))
    notes = [f"best tree / best single-chain speculative: {best_tree / best_chain:.2f}x",
             "edl: tokens per target forward; mean_accepted: draft tokens accepted per verification"]
    return _report(args, f"tree-{target.name}", "Token trees vs single-chain speculative decoding",
                   {"target": target.name, "draft": args.draft, "prompts": len(prompts), "max_new_tokens": max_new},
                   rows, notes)


def _rows_per_kind(cfgs, tallies, prompts, engine, kinds: list[str]) -> list[dict]:
    """Rows per prompt kind ("all" = every prompt), each with ratios to ar within that kind."""
    rows = []
    for kind in kinds:
        idx = [i for i, p in enumerate(prompts) if kind == "all" or p.kind.startswith(kind)]
        if not idx:
            continue
        subset = {name: t.subset(idx) for name, t in tallies.items()}
        rows += [{"kind": kind, **r} for r in tabulate(cfgs, subset, [prompts[i] for i in idx], engine.target,
                                                        quality=False)]
    return rows


def _lookahead_notes(rows: list[dict], lengths: list[int]) -> list[str]:
    notes = []
    for kind in ("xsum", "multilexsum", "humaneval", "mtbench"):
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        la = [r for r in mine if r["config"].startswith("lookahead")]
        best = max(la, key=lambda r: r["tok_s"])
        hf = next((r for r in mine if r["config"] == HF_PLD), None)
        notes.append(f"{kind}: best {best['config']} {best['ratio_vs_ar']:.2f}x ar"
                     + (f", {best['tok_s'] / hf['tok_s']:.2f}x HF prompt lookup" if hf else "")
                     + f" (EDL {best['edl']:.2f})")
    notes.append("edl: effective decoding length, tokens per target forward")
    return notes


def _report(args, name: str, title: str, meta: dict, rows: list[dict], notes: list[str]) -> int:
    from calid.backends import cpu_summary

    meta["threads"] = torch.get_num_threads()
    meta["cpu"] = cpu_summary()
    notes.append(cpu_summary())
    js, md = write_report(Path(args.out), name, title, meta, rows, COLUMNS, notes)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0
