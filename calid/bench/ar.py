"""``calid bench ar``: calid's AR decoding beside the best peer on the same machine, side by side.

Same model file, same prompts (HumanEval), same greedy settings, fixed output
length (EOS ignored by all), batch 1 and batch B, alternating runs so every
system sees the same machine noise. The peer is llama.cpp's own generation of
the same GGUF when calid runs on llama.cpp, HF transformers ``generate`` on the
same weights when it runs on torch (``--hf`` adds it to a llama.cpp run too).
Prints tokens/s, the ratio, the CPU flags and the memory-bandwidth limit for
the weight bytes one decode step reads in the format actually used.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from calid.bench.data import humaneval_prompts
from calid.bench.hardware import decode_limit_tok_s, memory_bandwidth_gbs
from calid.bench.baselines import LlamaCppOwn, add_backend_args
from calid.bench.report import write_report
from calid.progress import progress

COLUMNS = ["system", "batch", "tokens", "seconds", "tok_s", "ratio_vs_peer", "limit_tok_s", "same_tokens_as_peer"]


def add_parser(sub) -> None:
    from calid.models.presets import DEFAULT_TARGET

    p = sub.add_parser("ar", help="calid AR decoding vs llama.cpp's own / HF generate (batch 1 and batch B)")
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--prompts", type=int, default=4, help="batch-1 prompts (default 4)")
    p.add_argument("--batch", type=int, default=8, help="batch size of the batched run (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--full", action="store_true", help="all 164 HumanEval prompts at batch 1, 256 new tokens")
    p.add_argument("--hf", action="store_true", help="also run HF transformers generate (dequantized fp32 weights)")
    p.add_argument("--out", default="bench_results", help="folder for the JSON and Markdown tables")
    add_backend_args(p)
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=run)


def run(args) -> int:
    from calid.backends import cpu_summary, gguf_file, open_model
    from calid.errors import CalidError
    from calid.engine import Engine
    from calid.generation import GenerationRequest, SamplingParams
    from calid.text import encode_prompt

    n_prompts, new_tokens = (164, 256) if args.full else (args.prompts, args.max_new_tokens)
    if n_prompts < 1 or new_tokens < 1 or args.batch < 1:
        raise CalidError("--prompts, --max-new-tokens and --batch must be >= 1")
    lm = open_model(args.model, args.backend, args.dtype, args.device)
    tok = lm.tokenizer
    prompts = [encode_prompt(tok, p) for p in humaneval_prompts(max(n_prompts, args.batch))]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    ours = Engine(lm.runner, tok, lm.eos_ids, max_batch=args.batch)
    systems = {"calid AR": None}
    if lm.backend == "llamacpp":
        own = LlamaCppOwn(gguf_file(args.model, False), lm.runner.threads)
        systems[own.name] = lambda batch: _one_by_one(own.generate, batch, new_tokens)
    if lm.backend == "torch" or args.hf:
        systems["HF generate"] = _hf_runner(lm, args, new_tokens)
    peer = list(systems)[1]

    def run_ours(batch: list[list[int]]) -> tuple[float, list[list[int]]]:
        t = time.perf_counter()
        res = ours.generate([GenerationRequest(ids, params) for ids in batch])
        return time.perf_counter() - t, [r.output_ids for r in res]

    systems["calid AR"] = run_ours
    batched = {name: fn for name, fn in systems.items() if name != LlamaCppOwn.name}  # llama.cpp's own: batch 1 only
    print(f"bench ar: {lm.describe()}; {n_prompts} HumanEval prompts at batch 1, {args.batch} at batch {args.batch}; "
          f"{new_tokens} new tokens each (EOS ignored), greedy; peer: {peer}", file=sys.stderr)
    print(cpu_summary(), file=sys.stderr)
    for fn in systems.values():
        fn([prompts[0][:8]])  # warm-up
    bandwidth = memory_bandwidth_gbs()
    limit1 = decode_limit_tok_s(bandwidth, lm.decode_read_bytes)

    totals = {name: [0.0, 0, 0] for name in systems}  # seconds, tokens, sequences identical to the peer's
    with progress(n_prompts * len(systems) + len(batched), "bench ar", "run") as bar:
        for i, ids in enumerate(prompts[:n_prompts]):
            names = list(systems)
            outs = {}
            for name in names[i % len(names):] + names[: i % len(names)]:
                secs, outs[name] = systems[name]([ids])
                totals[name][0] += secs
                totals[name][1] += new_tokens
                bar.update(1)
            for name in systems:
                totals[name][2] += outs[name] == outs[peer]
        batch = prompts[: args.batch]
        batch_runs = {}
        for name, fn in batched.items():
            batch_runs[name] = fn(batch)
            bar.update(1)

    tok1 = {k: v[1] / v[0] for k, v in totals.items()}
    rows = _rows(totals, batch_runs, peer, n_prompts, args.batch, new_tokens, limit1)
    scaling = rows[-len(batch_runs)]["tok_s"] / tok1["calid AR"]
    meta = {"model": lm.name, "backend": lm.backend, "dtype": lm.dtype, "device": args.device,
            "weight_bytes_read_per_step": lm.decode_read_bytes, "bandwidth_GBps": round(bandwidth, 1),
            "threads": getattr(lm.runner, "threads", torch.get_num_threads()), "cpu": cpu_summary(),
            "prompts_batch1": n_prompts, "new_tokens": new_tokens}
    notes = [
        f"calid / {peer} at batch 1: {tok1['calid AR'] / tok1[peer]:.2f}x",
        f"calid batch-{args.batch} throughput / batch-1 throughput: {scaling:.2f}x",
        f"limit = measured bandwidth {bandwidth:.1f} GB/s / weight bytes read per step "
        f"{lm.decode_read_bytes / 1e9:.2f} GB "
        f"({lm.dtype}) = {limit1:.2f} tok/s per step (x batch when weights are read once per step)",
        "time includes prefill; same_tokens_as_peer counts sequences identical token for token",
        cpu_summary(),
    ]
    js, md = write_report(Path(args.out), f"ar-{lm.name}-{lm.backend}", f"calid AR vs {peer}", meta, rows, COLUMNS,
                          notes)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0


def _rows(totals: dict, batch_runs: dict, peer: str, n_prompts: int, batch: int, new_tokens: int,
          limit1: float) -> list[dict]:
    """The table: each system at batch 1 (``totals``: seconds, tokens, sequences as the peer's), then batched."""
    tok1 = {k: v[1] / v[0] for k, v in totals.items()}
    rows = [{"system": name, "batch": 1, "tokens": totals[name][1], "seconds": totals[name][0], "tok_s": tok1[name],
             "ratio_vs_peer": tok1[name] / tok1[peer], "limit_tok_s": limit1,
             "same_tokens_as_peer": "-" if name == peer else f"{totals[name][2]}/{n_prompts}"} for name in totals]
    b_peer = batch_runs.get(peer)
    for name, (secs, outs) in batch_runs.items():
        same = sum(a == b for a, b in zip(outs, b_peer[1])) if b_peer else None
        rows.append({"system": name, "batch": batch, "tokens": batch * new_tokens, "seconds": secs,
                     "tok_s": batch * new_tokens / secs,
                     "ratio_vs_peer": (b_peer[0] / secs) if b_peer else "-",
                     "limit_tok_s": batch * limit1,
                     "same_tokens_as_peer": "-" if name == peer or same is None else f"{same}/{batch}"})
    return rows


def _one_by_one(generate, batch: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    t = time.perf_counter()
    outs = [generate(ids, new_tokens) for ids in batch]
    return time.perf_counter() - t, outs


def _hf_runner(lm, args, new_tokens: int):
    """HF transformers generate on the same model's dequantized weights (left-padded batches)."""
    from transformers import AutoModelForCausalLM

    from calid.backends import pick_dtype
    from calid.models.loader import parse_dtype
    from calid.models.source import resolve

    dtype = parse_dtype(pick_dtype(args.dtype, args.device))
    hf = AutoModelForCausalLM.from_pretrained(str(resolve(args.model).path), dtype=dtype).to(args.device).eval()
    tok = lm.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else next(iter(lm.eos_ids))

    @torch.inference_mode()
    def run_hf(batch: list[list[int]]) -> tuple[float, list[list[int]]]:
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(b)) + b for b in batch], device=args.device)
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch], device=args.device)
        t = time.perf_counter()
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
        return time.perf_counter() - t, out[:, width:].tolist()

    return run_hf
