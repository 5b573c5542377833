"""``calid bench dtype``: torch fp32 vs bf16 decode steps on this CPU, side by side.

The measurement behind ``--dtype auto``: bf16 pays only where the CPU has
native bf16 instructions (avx512_bf16 / amx_bf16); elsewhere it is emulated and
slower than fp32. Both copies of the model decode the same batches in
alternation; the table gives ms per decode step, the ratio and the bandwidth
limit for each format's weight bytes.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from calid.bench.hardware import decode_limit_tok_s, memory_bandwidth_gbs
from calid.bench.report import parse_numbers, write_report

COLUMNS = ["dtype", "batch", "ms_per_step", "tok_s", "speedup_vs_fp32", "limit_tok_s"]


def add_parser(sub) -> None:
    from calid.models.presets import DEFAULT_DRAFT

    p = sub.add_parser("dtype", help="torch fp32 vs bf16 decode steps on this CPU (the rule behind --dtype auto)")
    p.add_argument("--model", default=DEFAULT_DRAFT)
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default 1,8)")
    p.add_argument("--context", type=int, default=128, help="tokens already cached per sequence")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per batch size and dtype")
    p.add_argument("--out", default="bench_results")
    p.set_defaults(func=run)


def run(args) -> int:
    from calid.backends import cpu_summary, pick_dtype
    from calid.models.loader import load_model
    from calid.runtime.runner import ModelRunner, SeqInput

    batches = parse_numbers(args.batches, int)
    models = {dt: load_model(args.model, dt) for dt in ("fp32", "bf16")}
    bandwidth = memory_bandwidth_gbs()
    print(f"bench dtype: {args.model}; decode steps at batch {batches} after {args.context} cached tokens; "
          f"{cpu_summary()}; --dtype auto picks {pick_dtype('auto', 'cpu')}", file=sys.stderr)
    ms = {}
    for b in batches:
        runners = {dt: ModelRunner(lm.model) for dt, lm in models.items()}
        for dt, r in runners.items():  # prefill every sequence once
            r.forward([SeqInput(i, list(range(10, 10 + args.context))) for i in range(b)])
        times = {dt: [] for dt in runners}
        for step in range(args.steps + 1):
            for dt, r in (list(runners.items()) if step % 2 else list(runners.items())[::-1]):
                t = time.perf_counter()
                r.forward([SeqInput(i, [100 + step]) for i in range(b)])
                if step:  # the first step warms up
                    times[dt].append(time.perf_counter() - t)
        for dt in runners:
            ms[dt, b] = 1000 * sorted(times[dt])[len(times[dt]) // 2]
    rows = [{"dtype": dt, "batch": b, "ms_per_step": ms[dt, b], "tok_s": 1000 * b / ms[dt, b],
             "speedup_vs_fp32": ms["fp32", b] / ms[dt, b],
             "limit_tok_s": b * decode_limit_tok_s(bandwidth, models[dt].decode_read_bytes)}
            for b in batches for dt in models]
    notes = [
        cpu_summary(),
        f"--dtype auto picks {pick_dtype('auto', 'cpu')} on this CPU",
        f"limit = {bandwidth:.1f} GB/s / weight bytes read per step (fp32 "
        f"{models['fp32'].decode_read_bytes / 1e9:.2f} GB, "
        f"bf16 {models['bf16'].decode_read_bytes / 1e9:.2f} GB) x batch",
        "ms_per_step: median of the timed steps",
    ]
    js, md = write_report(Path(args.out), f"dtype-{args.model}", "torch fp32 vs bf16 decode steps on this CPU",
                          {"model": args.model, "context": args.context, "threads": torch.get_num_threads(),
                           "cpu": cpu_summary()}, rows, COLUMNS, notes)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0
