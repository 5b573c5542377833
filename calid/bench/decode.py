"""``calid bench decode``: every draft/target mode side by side on the real Qwen pair.

For each prompt (HumanEval, then MT-bench first turns) every configuration runs
once at batch 1, in rotated order so machine drift spreads evenly: ar (target
only), speculative with fixed and dynamic gamma, filter and rollback at several
thresholds, draft only, and HF transformers assisted generation
(``assistant_model=``) on the same pair. Prints tokens/s, ratios to ar, the
filtered fraction and acceptance length; for quality: prefix agreement with
the target's greedy output, target-scored NLL, and HumanEval pass@1. Writes
JSON, Markdown and a PNG of quality vs filtered fraction (CALID Fig. 3 view).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from calid.bench.data import humaneval, humaneval_prompts, mtbench_questions
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
    p.add_argument("--no-hf", action="store_true", help="skip HF assisted generation")
    p.add_argument("--full", action="store_true", help="all 164 HumanEval + 80 MT-bench prompts, 512 new tokens")
    p.add_argument("--out", default="bench_results")
    p.set_defaults(func=run)


def configs(args) -> list[tuple[str, DecodeParams | None]]:
    out = [("ar (target only)", DecodeParams(mode="ar")),
           ("speculative gamma=4", DecodeParams(mode="speculative", gamma=4, threshold=0.0)),
           ("speculative dynamic gamma<=8 t=0.4", DecodeParams(mode="speculative", gamma=8, threshold=0.4))]
    for t in parse_numbers(args.filter_thresholds):
        out.append((f"filter t={t:g}", DecodeParams(mode="filter", gamma=8, threshold=t)))
    for r in parse_numbers(args.rollback_nlls):
        out.append((f"rollback t=0.4 nll>{r:g}", DecodeParams(mode="rollback", gamma=8, threshold=0.4, rollback_nll=r)))
    out.append(("draft only (filter t=0)", DecodeParams(mode="filter", gamma=8, threshold=0.0)))
    if not args.no_hf:
        out.append((HF_ASSISTED, None))
    return out



def run(args) -> int:
    from transformers import AutoModelForCausalLM

    from calid.cli import build_engine
    from calid.errors import CalidError
    from calid.generation import GenerationRequest, SamplingParams
    from calid.models.loader import load_model
    from calid.text import encode_prompt

    n_he, n_mt, max_new = (164, 80, 512) if args.full else (args.humaneval, args.mtbench, args.max_new_tokens)
    target = load_model(args.target)
    engine = build_engine(target, args.draft, "fp32", "cpu", max_batch=1)
    tok = target.tokenizer
    problems = humaneval()[:n_he]
    prompts = [Prompt("humaneval", encode_prompt(tok, text), max_new, prob)
               for text, prob in zip(humaneval_prompts(n_he), problems)]
    prompts += [Prompt("mtbench", encode_prompt(tok, q["turns"][0]), max(16, max_new // 2))
                for q in mtbench_questions()[:n_mt]]
    cfgs = configs(args)
    hf_target = hf_draft = None
    if not args.no_hf:
        hf_target = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=torch.float32).eval()
        draft_path = load_model(args.draft, show_progress=False).path if not args.draft.startswith("self:") else None
        if draft_path is None:
            raise CalidError("HF assisted generation needs a separate draft model; use --no-hf with self:N")
        hf_draft = AutoModelForCausalLM.from_pretrained(str(draft_path), dtype=torch.float32).eval()

    print(f"bench decode: target {target.name}, draft {args.draft}; {n_he} HumanEval + {n_mt} MT-bench prompts, "
          f"up to {max_new} new tokens (HumanEval) at batch 1, greedy; {len(cfgs)} configurations", file=sys.stderr)
    warm = GenerationRequest(prompts[0].ids[:16], SamplingParams(max_new_tokens=4), decode=DecodeParams(mode="speculative"))
    engine.generate([warm])  # first-call allocations out of the timings

    hf_fn = None
    if hf_target is not None:
        hf_fn = lambda ids, n: _hf_assisted(hf_target, hf_draft, ids, n, target.eos_ids)
    runs = [(name, hf_fn if decode is None else decode) for name, decode in cfgs]
    tallies = run_configs(engine, tok, prompts, runs, "bench decode")
    rows = tabulate(runs, tallies, prompts, engine.target)
    _print_and_write(args, target.name, rows, n_he, n_mt, max_new)
    return 0


@torch.inference_mode()
def _hf_assisted(hf_target, hf_draft, ids: list[int], max_new: int, eos_ids) -> list[int]:
    x = torch.tensor([ids])
    out = hf_target.generate(input_ids=x, attention_mask=torch.ones_like(x), assistant_model=hf_draft,
                             do_sample=False, max_new_tokens=max_new, eos_token_id=sorted(eos_ids))
    return out[0, len(ids):].tolist()


def _print_and_write(args, target_name: str, rows: list[dict], n_he: int, n_mt: int, max_new: int) -> None:
    from calid.bench.plot import quality_vs_filtered

    by = {r["config"]: r for r in rows}
    notes = []
    for name in ("speculative gamma=4", "speculative dynamic gamma<=8 t=0.4"):
        r = by[name]
        line = f"{name} vs ar: {r['ratio_vs_ar']:.2f}x"
        if HF_ASSISTED in by:
            line += f", vs HF assisted generation: {r['tok_s'] / by[HF_ASSISTED]['tok_s']:.2f}x"
        notes.append(line)
    notes += [
        "lossless modes (speculative) must show agreement_with_ar = 1.0 under greedy decoding",
        "agreement_with_ar: share of the target's greedy output reproduced before the first difference",
        "target_nll: mean NLL the target assigns to each configuration's output tokens (lower = closer to the target)",
        f"pass_at_1 over {n_he} HumanEval problems: a small default subset, coarse (use --full for all 164)",
    ]
    meta = {"target": target_name, "draft": args.draft, "prompts": f"{n_he} HumanEval + {n_mt} MT-bench",
            "max_new_tokens": max_new, "batch": 1, "sampling": "greedy", "threads": torch.get_num_threads()}
    out = Path(args.out)
    js, md = write_report(out, f"decode-{target_name}", "calid draft/target decoding, side by side", meta, rows,
                          COLUMNS, notes)
    png = quality_vs_filtered(rows, out / f"decode-{target_name}.png")
    print(md.read_text())
    print(f"wrote {js}, {md} and {png}", file=sys.stderr)
