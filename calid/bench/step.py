"""``calid bench step``: one decode step of the torch runtime, contiguous vs paged KV, side by side.

The measurement behind the default ``kv_layout`` (paged). Both runners hold the same
sequences (the same prompt per sequence, ``--context`` tokens cached) and
decode the same tokens in alternation, so both see the same machine noise:

* ``contiguous``: a KV buffer per sequence, one attention call per sequence and
  layer (the runtime before the paged cache);
* ``paged``: one block pool, one attention call per layer for the batch.

Rows: ms per decode step (median), the speedup of paged, and host ms: the
Python bookkeeping of a step outside the model (matching the ids against the
cache, building the batch, planning attention), which is what grows with
context if anything walks the ids. The bandwidth limit is the weight bytes one
step must read; a step at batch B cannot beat it.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from calid.bench.hardware import memory_bandwidth_gbs
from calid.bench.report import parse_numbers, write_report

LAYOUTS = ("contiguous", "paged")
COLUMNS = ["batch", "context", "layout", "ms_per_step", "host_ms", "paged_speedup", "limit_ms"]


def add_parser(sub) -> None:
    from calid.models.presets import TEST_MODEL

    p = sub.add_parser("step", help="torch decode step: contiguous vs paged KV cache, batch 1/16/32 and 4k context")
    p.add_argument("--model", default=TEST_MODEL)
    p.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU has it natively), fp32 or bf16")
    p.add_argument("--batches", default="1,16,32", help="comma-separated batch sizes (default 1,16,32)")
    p.add_argument("--context", type=int, default=256, help="tokens cached per sequence (default 256)")
    p.add_argument("--long-context", type=int, default=4096, help="context of the extra batch-1 row (0: none)")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per row and layout (default 8)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="bench_results")
    p.set_defaults(func=run)


def _prompt(seq: int, n: int) -> list[int]:
    return [(7 * seq + j) % 1000 + 5 for j in range(n)]


def _host_ms(runner, batch: int, ids: dict[int, list[int]]) -> float:
    """Bookkeeping of one step: match every sequence's ids against its cache, build the batch, plan attention."""
    from calid.runtime.attention import attention_for
    from calid.runtime.runner import SeqInput

    t = time.perf_counter()
    inputs = [SeqInput(i, runner.sync(i, ids[i])) for i in range(batch)]
    attention_for(runner._build_batch(inputs))
    return 1000 * (time.perf_counter() - t)


def measure(model, batch: int, context: int, steps: int) -> dict[str, tuple[float, float]]:
    """(median ms per step, median host ms) per layout, both decoding the same tokens in alternation."""
    from calid.runtime.runner import ModelRunner, SeqInput

    runners = {layout: ModelRunner(model, kv_layout=layout) for layout in LAYOUTS}
    ids = {i: _prompt(i, context) for i in range(batch)}
    for r in runners.values():
        for i in range(batch):  # one prefill per sequence, as requests arrive
            r.forward([SeqInput(i, ids[i])])
    times = {layout: ([], []) for layout in LAYOUTS}
    for step in range(steps + 1):
        for i in range(batch):
            ids[i].append(100 + step)
        order = LAYOUTS if step % 2 else LAYOUTS[::-1]
        for layout in order:
            r = runners[layout]
            host = _host_ms(r, batch, ids)
            t = time.perf_counter()
            r.forward([SeqInput(i, r.sync(i, ids[i])) for i in range(batch)])
            if step:  # the first step warms up
                times[layout][0].append(1000 * (time.perf_counter() - t))
                times[layout][1].append(host)
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {layout: (median(ms), median(host)) for layout, (ms, host) in times.items()}


def run(args) -> int:
    from calid.backends import cpu_summary, pick_dtype
    from calid.errors import CalidError
    from calid.models.loader import load_model
    from calid.runtime.runner import DEFAULT_KV_LAYOUT

    batches = parse_numbers(args.batches, int)
    if not batches or min(batches) < 1 or args.context < 1 or args.steps < 1 or args.long_context < 0:
        raise CalidError("--batches, --context and --steps must be >= 1 (--long-context >= 0)")
    dtype = pick_dtype(args.dtype, args.device)
    lm = load_model(args.model, dtype, device=args.device, show_progress=False)
    bandwidth = memory_bandwidth_gbs() if args.device == "cpu" else None
    limit_ms = 1000 * lm.decode_read_bytes / (bandwidth * 1e9) if bandwidth else None
    shapes = [(b, args.context) for b in batches] + ([(1, args.long_context)] if args.long_context else [])
    print(f"bench step: {args.model} {dtype} on {args.device}; {cpu_summary()}; "
          f"default kv_layout {DEFAULT_KV_LAYOUT}", file=sys.stderr)
    rows = []
    for n, (b, ctx) in enumerate(shapes, 1):
        print(f"[{n}/{len(shapes)}] batch {b}, context {ctx}", file=sys.stderr)
        got = measure(lm.model, b, ctx, args.steps)
        for layout in LAYOUTS:
            ms, host = got[layout]
            rows.append({"batch": b, "context": ctx, "layout": layout, "ms_per_step": ms, "host_ms": host,
                         "paged_speedup": got["contiguous"][0] / got["paged"][0], "limit_ms": limit_ms})
    notes = [cpu_summary(), f"threads {torch.get_num_threads()}; default kv_layout {DEFAULT_KV_LAYOUT}",
             "paged_speedup: contiguous ms / paged ms for the row's shape (> 1: paged is faster)",
             "host_ms: id matching + batch building + attention planning of one step (median)",
             f"limit_ms: {lm.decode_read_bytes / 1e9:.2f} GB of weights per step / "
             + (f"{bandwidth:.1f} GB/s measured memory bandwidth" if bandwidth else "n/a off CPU")]
    js, md = write_report(Path(args.out), f"step-{args.model}", "decode step: contiguous vs paged KV cache",
                          {"model": args.model, "dtype": dtype, "device": args.device, "steps": args.steps,
                           "cpu": cpu_summary()}, rows, COLUMNS, notes)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0
