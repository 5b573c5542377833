"""``calid bench ar``: our AR decoding vs HF transformers ``generate``, side by side.

Same model folder, same prompts (HumanEval), same greedy settings, fixed output
length (EOS ignored by both), batch 1 and batch B, alternating runs so both
systems see the same machine noise. Prints tokens/s, the ratio, and the
memory-bandwidth limit.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from calid.bench.data import humaneval_prompts
from calid.bench.hardware import decode_limit_tok_s, memory_bandwidth_gbs
from calid.bench.report import write_report
from calid.progress import progress

COLUMNS = ["system", "batch", "tokens", "seconds", "tok_s", "ratio_vs_hf", "limit_tok_s", "same_tokens_as_hf"]


def add_parser(sub) -> None:
    from calid.models.presets import DEFAULT_TARGET

    p = sub.add_parser("ar", help="calid AR decoding vs HF transformers generate (batch 1 and batch B)")
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--prompts", type=int, default=4, help="batch-1 prompts (default 4)")
    p.add_argument("--batch", type=int, default=8, help="batch size of the batched run (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--full", action="store_true", help="all 164 HumanEval prompts at batch 1, 256 new tokens")
    p.add_argument("--out", default="bench_results", help="folder for the JSON and Markdown tables")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=run)


def run(args) -> int:
    from transformers import AutoModelForCausalLM

    from calid.errors import CalidError
    from calid.engine import Engine
    from calid.generation import GenerationRequest, SamplingParams
    from calid.models.loader import load_model, parse_dtype
    from calid.runtime.runner import ModelRunner
    from calid.text import encode_prompt

    n_prompts, new_tokens = (164, 256) if args.full else (args.prompts, args.max_new_tokens)
    if n_prompts < 1 or new_tokens < 1 or args.batch < 1:
        raise CalidError("--prompts, --max-new-tokens and --batch must be >= 1")
    lm = load_model(args.model, args.dtype, args.device)
    hf = AutoModelForCausalLM.from_pretrained(str(lm.path), dtype=parse_dtype(args.dtype)).to(args.device).eval()
    tok = lm.tokenizer
    prompts = [encode_prompt(tok, p) for p in humaneval_prompts(max(n_prompts, args.batch))]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    ours = Engine(ModelRunner(lm.model), tok, lm.eos_ids, max_batch=args.batch)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else next(iter(lm.eos_ids))

    def run_ours(batch: list[list[int]]) -> tuple[float, list[list[int]]]:
        t = time.perf_counter()
        res = ours.generate([GenerationRequest(ids, params) for ids in batch])
        return time.perf_counter() - t, [r.output_ids for r in res]

    @torch.inference_mode()
    def run_hf(batch: list[list[int]]) -> tuple[float, list[list[int]]]:
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(b)) + b for b in batch], device=args.device)
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch], device=args.device)
        t = time.perf_counter()
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
        return time.perf_counter() - t, out[:, width:].tolist()

    print(f"bench ar: {lm.name} {args.dtype} on {args.device}; {n_prompts} HumanEval prompts at batch 1, "
          f"{args.batch} at batch {args.batch}; {new_tokens} new tokens each (EOS ignored), greedy", file=sys.stderr)
    run_ours([prompts[0][:8]]), run_hf([prompts[0][:8]])  # warm-up
    bandwidth = memory_bandwidth_gbs()
    limit1 = decode_limit_tok_s(bandwidth, lm.decode_read_bytes)

    totals = {"calid": [0.0, 0, 0], "hf": [0.0, 0, 0]}  # seconds, tokens, same-token sequences
    with progress(n_prompts * 2 + 2, "bench ar", "run") as bar:
        for i, ids in enumerate(prompts[:n_prompts]):
            order = [("calid", run_ours), ("hf", run_hf)] if i % 2 == 0 else [("hf", run_hf), ("calid", run_ours)]
            outs = {}
            for name, fn in order:
                secs, outs[name] = fn([ids])
                totals[name][0] += secs
                totals[name][1] += new_tokens
                bar.update(1)
            totals["calid"][2] += outs["calid"] == outs["hf"]
        batch = prompts[: args.batch]
        b_ours, out_ours = run_ours(batch)
        bar.update(1)
        b_hf, out_hf = run_hf(batch)
        bar.update(1)

    same_b = sum(a == b for a, b in zip(out_ours, out_hf))
    tok1 = {k: v[1] / v[0] for k, v in totals.items()}
    tokb = {"calid": args.batch * new_tokens / b_ours, "hf": args.batch * new_tokens / b_hf}
    rows = [
        {"system": "calid AR", "batch": 1, "tokens": totals["calid"][1], "seconds": totals["calid"][0],
         "tok_s": tok1["calid"], "ratio_vs_hf": tok1["calid"] / tok1["hf"], "limit_tok_s": limit1,
         "same_tokens_as_hf": f"{totals['calid'][2]}/{n_prompts}"},
        {"system": "HF generate", "batch": 1, "tokens": totals["hf"][1], "seconds": totals["hf"][0],
         "tok_s": tok1["hf"], "ratio_vs_hf": 1.0, "limit_tok_s": limit1, "same_tokens_as_hf": "-"},
        {"system": "calid AR", "batch": args.batch, "tokens": args.batch * new_tokens, "seconds": b_ours,
         "tok_s": tokb["calid"], "ratio_vs_hf": tokb["calid"] / tokb["hf"], "limit_tok_s": args.batch * limit1,
         "same_tokens_as_hf": f"{same_b}/{args.batch}"},
        {"system": "HF generate", "batch": args.batch, "tokens": args.batch * new_tokens, "seconds": b_hf,
         "tok_s": tokb["hf"], "ratio_vs_hf": 1.0, "limit_tok_s": args.batch * limit1, "same_tokens_as_hf": "-"},
    ]
    scaling = tokb["calid"] / tok1["calid"]
    meta = {"model": lm.name, "dtype": args.dtype, "device": args.device, "weight_bytes_read_per_step": lm.decode_read_bytes,
            "bandwidth_GBps": round(bandwidth, 1), "threads": torch.get_num_threads(),
            "prompts_batch1": n_prompts, "new_tokens": new_tokens}
    notes = [
        f"calid/HF at batch 1: {rows[0]['ratio_vs_hf']:.2f}x; at batch {args.batch}: {rows[2]['ratio_vs_hf']:.2f}x",
        f"calid batch-{args.batch} throughput / batch-1 throughput: {scaling:.2f}x",
        f"limit = measured bandwidth {bandwidth:.1f} GB/s / weight bytes read per step {lm.decode_read_bytes / 1e9:.2f} GB "
        f"= {limit1:.2f} tok/s per step (x batch when weights are read once per step)",
        "time includes prefill; same_tokens_as_hf counts sequences identical token for token",
    ]
    js, md = write_report(Path(args.out), f"ar-{lm.name}", "calid AR vs HF transformers generate", meta, rows,
                          COLUMNS, notes)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0
