"""``calid bench invariance``: batch-invariant vs ordinary torch forwards, side by side, bf16 and fp32; with
``--backend llamacpp``, how many tokens one llama.cpp call may feed a sequence and still give every row exactly as a
one-token step does (what the runner's exact mode relies on), on repacked and on unrepacked weights.

Two runners over two copies of the same weights decode (and verify) the same tokens in alternation, so both
see the same machine noise. Rows per dtype and batch: ms per decode step (one token per sequence) and per
verification step (``--verify`` tokens per sequence), the invariant runner's throughput relative to the
ordinary one, and a check that the invariant runner's logits for sequence 0 are bit-identical alone and
inside the batch (the ordinary runner's usually are not). The bandwidth limit is one step's weight bytes.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from calid.bench.hardware import memory_bandwidth_gbs
from calid.bench.report import parse_numbers, write_report

COLUMNS = ["dtype", "batch", "kind", "variant_ms", "invariant_ms", "throughput_ratio", "variant_exact",
           "invariant_exact", "limit_ms"]


def add_parser(sub) -> None:
    from calid.models.presets import TEST_MODEL

    p = sub.add_parser("invariance", help="batch-invariant vs ordinary torch forwards: cost (bf16, fp32) and exactness")
    p.add_argument("--model", default=TEST_MODEL)
    p.add_argument("--backend", choices=["torch", "llamacpp"], default="torch",
                   help="llamacpp: the largest exact call per weight layout (the model's GGUF), not the torch rows")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--batches", default="1,8,16")
    p.add_argument("--context", type=int, default=None,
                   help="tokens cached per sequence (default 256; llamacpp 128: past 256 positions llama.cpp's flash "
                        "attention splits its work by the call's rows, and no call but a one-token one is exact)")
    p.add_argument("--verify", type=int, default=8, help="tokens per sequence in a verification step (default 8)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per row (default 6)")
    p.add_argument("--out", default="bench_results")
    p.set_defaults(func=run)


def _prompt(seq: int, n: int) -> list[int]:
    return [(7 * seq + j) % 1000 + 5 for j in range(n)]


def _step(runner, batch: int, ids: dict, new: int) -> tuple[float, torch.Tensor]:
    """One forward feeding ``new`` tokens per sequence (logits at each); (ms, sequence 0's logits)."""
    from calid.runtime.runner import SeqInput

    t = time.perf_counter()
    out = runner.forward([SeqInput(i, runner.sync(i, ids[i])[-new:], logits_at=list(range(new)))
                          for i in range(batch)])
    return 1000 * (time.perf_counter() - t), out[0]


def _alone(runner, ids: list[int], new: int) -> torch.Tensor:
    from calid.runtime.runner import SeqInput

    runner.release("alone")
    runner.forward([SeqInput("alone", ids[:-new])])
    out = runner.forward([SeqInput("alone", ids[-new:], logits_at=list(range(new)))])[0]
    runner.release("alone")
    return out


def measure(runners: dict, batch: int, context: int, verify: int, steps: int) -> list[dict]:
    from calid.runtime.runner import SeqInput

    rows = []
    for kind, new in (("decode", 1), ("verify", verify)):
        ids = {i: _prompt(i, context) for i in range(batch)}
        for r in runners.values():
            for i in range(batch):
                r.release(i)
                r.forward([SeqInput(i, ids[i])])
        times = {name: [] for name in runners}
        exact = {}
        for step in range(steps + 1):
            for i in range(batch):
                ids[i] += [100 + (step * new + j) % 500 for j in range(new)]
            for name in (list(runners) if step % 2 else list(runners)[::-1]):
                ms, logits = _step(runners[name], batch, ids, new)
                if step:
                    times[name].append(ms)
                if step == steps:
                    exact[name] = torch.equal(logits, _alone(runners[name], ids[0], new))
        median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        rows.append({"batch": batch, "kind": kind, "variant_ms": median["variant"],
                     "invariant_ms": median["invariant"], "throughput_ratio": median["variant"] / median["invariant"],
                     "variant_exact": exact["variant"], "invariant_exact": exact["invariant"]})
    return rows


LLAMACPP_CONTEXT = 128  # cached tokens before the chain (kept below 256: see --context)
LLAMACPP_COLUMNS = ["weights", "exact_rows", "first_inexact", "step_ms", "runner_cut", "cut_holds"]


def exact_rows(runner, ids: list[int], most: int = 16, repeats: int = 5) -> tuple[int, float]:
    """The most tokens one forward of ``runner`` may feed a sequence (after ``ids``, prefilled in one call) with
    every row bit-identical to one-token steps over the same tokens, from 1 to ``most`` (the first size that
    differs ends the search), and a one-token step's median ms. The tokens are the runner's greedy chain."""
    from calid.runtime.seq_input import SeqInput

    def prefilled(seq) -> torch.Tensor:
        runner.release(seq)
        return runner.forward([SeqInput(seq, list(ids))])[0][-1]

    token, steps, times = int(prefilled("steps").argmax()), [], []
    chain = []
    for _ in range(most):
        chain.append(token)
        t = time.perf_counter()
        row = runner.forward([SeqInput("steps", [token])])[0][-1]
        times.append(1000 * (time.perf_counter() - t))
        steps.append(row)
        token = int(row.argmax())
    runner.release("steps")
    exact = 1
    for k in range(2, most + 1):
        prefilled("call")
        rows = runner.forward([SeqInput("call", chain[:k], logits_at=list(range(k)))])[0]
        if not all(torch.equal(rows[i], steps[i]) for i in range(k)):
            break
        exact = k
    runner.release("call")
    return exact, sorted(times[-repeats:])[min(repeats, len(times)) // 2]


def run_llamacpp(args) -> int:
    """The largest exact call on the model's GGUF, repacked and unrepacked, beside the exact mode's cut."""
    from calid.backends import cpu_summary, gguf_file
    from calid.errors import CalidError
    from calid.runtime.llamacpp import EXACT_ROWS, LlamaCppRunner

    context = LLAMACPP_CONTEXT if args.context is None else args.context
    if context < 1 or args.verify < 1:
        raise CalidError("--context and --verify >= 1")
    gguf = gguf_file(args.model, show_progress=True)
    if gguf is None:
        raise CalidError(f"--backend llamacpp: {args.model} has no GGUF (a preset or a .gguf path)")
    print(f"bench invariance: {gguf.name} on llama.cpp; {cpu_summary()}", file=sys.stderr)
    rows = []
    for weights, repack in (("repacked", True), ("plain", False)):
        runner = LlamaCppRunner(gguf, kv_budget_bytes=256 << 20, slots=2, exact=False, prompt_cache=False,
                                repack=repack)
        try:
            exact, step_ms = exact_rows(runner, _prompt(0, context), most=args.verify * 2)
        finally:
            runner.close()
        rows.append({"weights": weights, "exact_rows": exact,
                     "first_inexact": exact + 1 if exact < args.verify * 2 else "-", "step_ms": step_ms,
                     "runner_cut": EXACT_ROWS if repack else "-",
                     "cut_holds": (EXACT_ROWS <= exact) if repack else "-"})
        print(f"  {weights}: calls of up to {exact} tokens exact; one-token step {step_ms:.1f} ms", file=sys.stderr)
    notes = [cpu_summary(), f"context {context} tokens; calls of 2 to {args.verify * 2} tokens tried",
             "exact_rows: the most tokens one call feeds a sequence with every row bit-identical to one-token steps "
             "over the same tokens (the kernels' small-batch path); first_inexact: the first size that differs",
             "runner_cut: the exact mode's largest call (calid.runtime.llamacpp.EXACT_ROWS, repacked weights); "
             "cut_holds: it is within exact_rows on this CPU",
             "step_ms: a one-token step, median of the last 5 of the chain's steps"]
    js, md = write_report(Path(args.out), f"invariance-llamacpp-{args.model}", "exact calls on llama.cpp",
                          {"model": args.model, "gguf": gguf.name, "cpu": cpu_summary(), "context": context},
                          rows, LLAMACPP_COLUMNS, notes)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0 if all(r["cut_holds"] is not False for r in rows) else 1


def run(args) -> int:
    if getattr(args, "backend", "torch") == "llamacpp":
        return run_llamacpp(args)
    if args.context is None:
        args.context = 256
    from calid.backends import cpu_summary
    from calid.errors import CalidError
    from calid.models.loader import load_model
    from calid.runtime.runner import ModelRunner

    batches = parse_numbers(args.batches, int)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not batches or min(batches) < 1 or args.context < args.verify or args.verify < 1 or args.steps < 1 \
            or not set(dtypes) <= {"bf16", "fp32"} or not dtypes:
        raise CalidError("--batches, --verify, --steps >= 1, --context >= --verify, --dtypes from bf16,fp32")
    bandwidth = memory_bandwidth_gbs()
    print(f"bench invariance: {args.model}; {cpu_summary()}; threads {torch.get_num_threads()}", file=sys.stderr)
    rows, meta_bytes = [], {}
    for dtype in dtypes:
        plain = load_model(args.model, dtype, show_progress=False)  # two copies: invariance converts its model
        runners = {"variant": ModelRunner(plain.model),
                   "invariant": ModelRunner(load_model(args.model, dtype, show_progress=False).model, invariant=True)}
        read = plain.decode_read_bytes
        meta_bytes[dtype] = read
        for b in batches:
            print(f"  {dtype} batch {b}", file=sys.stderr)
            for row in measure(runners, b, args.context, args.verify, args.steps):
                rows.append({"dtype": dtype, **row, "limit_ms": 1000 * read / (bandwidth * 1e9)})
    notes = [cpu_summary(), f"context {args.context} tokens per sequence; verify = {args.verify} tokens per sequence",
             "throughput_ratio = variant ms / invariant ms (1.0: invariance is free; 0.9: it costs 10%)",
             "*_exact: sequence 0's logits in the batch are bit-identical to the same forward with it alone",
             "limit_ms: one step's weight bytes / " + f"{bandwidth:.1f} GB/s measured bandwidth ("
             + ", ".join(f"{d}: {b / 1e9:.2f} GB" for d, b in meta_bytes.items()) + ")"]
    js, md = write_report(Path(args.out), f"invariance-{args.model}", "batch-invariant vs ordinary forwards",
                          {"model": args.model, "cpu": cpu_summary(), "context": args.context, "steps": args.steps},
                          rows, COLUMNS, notes)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0
