"""``calid bench decode``: every draft/target mode side by side on the real Qwen pair.

For each prompt (HumanEval, then MT-bench first turns) every configuration runs
once at batch 1, in rotated order so machine drift spreads evenly: ar (target
only), speculative with fixed and dynamic gamma, filter and rollback at several
thresholds, draft only, llama.cpp's own generation of the target's GGUF (the
best CPU peer; when calid runs on llama.cpp) and HF transformers assisted
generation (``assistant_model=``, on the dequantized pair, with ``--hf``). Prints tokens/s, ratios to ar, the
filtered fraction and acceptance length; for quality: prefix agreement with
the target's greedy output, target-scored NLL, and HumanEval pass@1. Writes
JSON, Markdown and a PNG of quality vs filtered fraction (CALID Fig. 3 view).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from calid.bench.data import humaneval, humaneval_prompts, mtbench_questions
from calid.bench.baselines import LlamaCppOwn, add_backend_args
from calid.bench.report import parse_numbers, write_report
from calid.bench.side_by_side import Prompt, run_configs, tabulate
from calid.decoding.modes import DecodeParams

COLUMNS = ["config", "tok_s", "ratio_vs_ar", "filtered_fraction", "mean_accepted", "edl", "target_calls_per_token",
           "agreement_with_ar", "target_nll", "pass_at_1", "tokens", "seconds"]
HF_ASSISTED = "HF assisted generation"


def add_parser(sub) -> None:
    from calid.models.presets import DEFAULT_DRAFT, DEFAULT_TARGET

    p = sub.add_parser("decode", help="ar / speculative / filter / rollback / HF assisted on a draft-target pair")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--humaneval", type=int, default=3, help="HumanEval prompts (default 3)")
    p.add_argument("--mtbench", type=int, default=1, help="MT-bench first-turn prompts (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="HumanEval cap; MT-bench gets half")
    p.add_argument("--filter-thresholds", default="0.4,0.7,0.9", help="comma-separated top-1 probabilities")
    p.add_argument("--rollback-nlls", default="1.5,4.0", help="comma-separated target NLL bounds")
    p.add_argument("--hf", action="store_true", help="also run HF assisted generation (dequantized fp32 pair; slow)")
    p.add_argument("--full", action="store_true", help="all 164 HumanEval + 80 MT-bench prompts, 512 new tokens")
    p.add_argument("--out", default="bench_results")
    add_backend_args(p)
    p.set_defaults(func=run)


def configs(args) -> list[tuple[str, DecodeParams | None]]:
    out = [("ar (target only)", DecodeParams(mode="ar")),
           ("speculative gamma=4", DecodeParams(mode="speculative", gamma=4, threshold=0.0)),
           ("speculative dynamic gamma<=8 t=0.4", DecodeParams(mode="speculative", gamma=8, threshold=0.4)),
           ("auto (planned per step)", DecodeParams(mode="auto", gamma=8, threshold=0.4))]
    for t in parse_numbers(args.filter_thresholds):
        out.append((f"filter t={t:g}", DecodeParams(mode="filter", gamma=8, threshold=t)))
    for r in parse_numbers(args.rollback_nlls):
        out.append((f"rollback t=0.4 nll>{r:g}", DecodeParams(mode="rollback", gamma=8, threshold=0.4, rollback_nll=r)))
    out.append(("draft only (filter t=0)", DecodeParams(mode="filter", gamma=8, threshold=0.0)))
    if args.hf:
        out.append((HF_ASSISTED, None))
    return out



def run(args) -> int:
    from transformers import AutoModelForCausalLM

    from calid.backends import cpu_summary, gguf_file, open_model
    from calid.backends import build_engine
    from calid.errors import CalidError
    from calid.generation import GenerationRequest, SamplingParams
    from calid.models.source import resolve
    from calid.text import encode_prompt

    n_he, n_mt, max_new = (164, 80, 512) if args.full else (args.humaneval, args.mtbench, args.max_new_tokens)
    target = open_model(args.target, args.backend, args.dtype)
    engine = build_engine(target, args.draft, args.backend, args.dtype, max_batch=1)
    tok = target.tokenizer
    problems = humaneval()[:n_he]
    prompts = [Prompt("humaneval", encode_prompt(tok, text), max_new, prob)
               for text, prob in zip(humaneval_prompts(n_he), problems)]
    prompts += [Prompt("mtbench", encode_prompt(tok, q["turns"][0]), max(16, max_new // 2))
                for q in mtbench_questions()[:n_mt]]
    cfgs = configs(args)
    runs = [(name, decode) for name, decode in cfgs if decode is not None]
    if target.backend == "llamacpp":  # the best CPU peer: llama.cpp decoding the target's GGUF by itself
        own = LlamaCppOwn(gguf_file(args.target, False), target.runner.threads)
        runs.insert(1, (LlamaCppOwn.name, own.external(target.eos_ids)))
    if args.hf:
        if args.draft.startswith("self:"):
            raise CalidError("HF assisted generation needs a separate draft model; drop --hf with self:N")
        hf_target = AutoModelForCausalLM.from_pretrained(str(resolve(args.target).path), dtype=torch.float32).eval()
        hf_draft = AutoModelForCausalLM.from_pretrained(str(resolve(args.draft).path), dtype=torch.float32).eval()
        runs.append((HF_ASSISTED, lambda ids, n: _hf_assisted(hf_target, hf_draft, ids, n, target.eos_ids)))

    print(f"bench decode: target {target.describe()}, draft {args.draft}; {n_he} HumanEval + {n_mt} MT-bench "
          f"prompts, up to {max_new} new tokens (HumanEval) at batch 1, greedy; {len(runs)} configurations",
          file=sys.stderr)
    print(cpu_summary(), file=sys.stderr)
    for mode in ("speculative", "auto"):  # first-call allocations, and auto's one-time calibration, out of the timings
        engine.generate([GenerationRequest(prompts[0].ids[:16], SamplingParams(max_new_tokens=4),
                                           decode=DecodeParams(mode=mode))])
    tallies = run_configs(engine, tok, prompts, runs, "bench decode")
    rows = tabulate(runs, tallies, prompts, engine.target)
    _print_and_write(args, target, rows, n_he, n_mt, max_new)
    return 0


@torch.inference_mode()
def _hf_assisted(hf_target, hf_draft, ids: list[int], max_new: int, eos_ids) -> list[int]:
    x = torch.tensor([ids])
    out = hf_target.generate(input_ids=x, attention_mask=torch.ones_like(x), assistant_model=hf_draft,
                             do_sample=False, max_new_tokens=max_new, eos_token_id=sorted(eos_ids))
    return out[0, len(ids):].tolist()


def _print_and_write(args, target, rows: list[dict], n_he: int, n_mt: int, max_new: int) -> None:
    from calid.backends import cpu_summary
    from calid.bench.plot import quality_vs_filtered

    by = {r["config"]: r for r in rows}
    notes = []
    peers = [p for p in (LlamaCppOwn.name, HF_ASSISTED) if p in by]
    for name in [n for n in by if n.startswith(("speculative", "filter", "auto"))]:
        r = by[name]
        line = f"{name} vs ar: {r['ratio_vs_ar']:.2f}x"
        line += "".join(f", vs {p}: {r['tok_s'] / by[p]['tok_s']:.2f}x" for p in peers)
        notes.append(line)
    notes += [
        "lossless modes (speculative) must show agreement_with_ar = 1.0 under greedy decoding",
        "agreement_with_ar: share of the target's greedy output reproduced before the first difference",
        "target_nll: mean NLL the target assigns to each configuration's output tokens (lower = closer to the target)",
        f"pass_at_1 over {n_he} HumanEval problems: a small default subset, coarse (use --full for all 164)",
        cpu_summary(),
    ]
    meta = {"target": target.describe(), "draft": args.draft, "prompts": f"{n_he} HumanEval + {n_mt} MT-bench",
            "max_new_tokens": max_new, "batch": 1, "sampling": "greedy", "cpu": cpu_summary(),
            "threads": getattr(target.runner, "threads", torch.get_num_threads())}
    out = Path(args.out)
    stem = f"decode-{target.name}-{target.backend}"
    js, md = write_report(out, stem, "calid draft/target decoding, side by side", meta, rows, COLUMNS, notes)
    png = quality_vs_filtered(rows, out / f"{stem}.png")
    print(md.read_text())
    print(f"wrote {js}, {md} and {png}", file=sys.stderr)
