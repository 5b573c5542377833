"""``calid bench placement``: where several models should run, AlpaServe's way, against its two baselines.

  --profile   times each model on its real backend with one thread (one "device": one core here): a decode
              step at batch 1, 2, 4, 8 and the prefill per prompt token; and how a 2-way tensor and a 2-way
              pipeline split change a step (Qwen 0.5B on torch, one process per core, gloo on loopback).
              Saved as JSON (CALID_HOME/placement/profile.json).
  --simulate  replays the Azure conversation trace's lengths with Gamma arrivals (--cv) or the trace's own
              gaps, over a cluster of --devices devices whose profiles are derived from the measured ones
              (calid.placement.profile.scaled: --copies copies of each model, TP/PP costs extended by
              doubling), plans with alpaserve, replication and dedicated, and prints each plan's SLO
              attainment; --plot sweeps rate, CV and SLO scale (the AlpaServe paper's three views).
  (neither)   live: plans for this machine's cores from the measured profile (the models as measured, one
              copy each), serves each plan (--live-plans) as a multi-model calid app with every model's
              replicas pinned to their group's cores, replays --duration seconds of the same arrivals through
              gRPC, and prints measured attainment beside the simulator's for the same requests
              (serve_app.bench.placement_live).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from calid.placement.traffic import DEFAULT_TRACE

DEFAULT_MODELS = "qwen2.5-coder-1.5b-instruct,qwen2.5-coder-0.5b-instruct,smollm2-135m-instruct"
BATCHES = (1, 2, 4, 8)
SCALED_CONFIGS = ["tp1xpp1", "tp2xpp1", "tp1xpp2", "tp4xpp1", "tp2xpp2", "tp1xpp4", "tp8xpp1", "tp4xpp2"]
PLANNER_ORDER = ("alpaserve", "replication", "dedicated")


def add_parser(sub, run_live=None) -> None:
    """``run_live(args)``: the live run (serve_app.bench.placement_live adds this command with it)."""
    p = sub.add_parser("placement", help="several models on one device pool: AlpaServe placement vs baselines")
    p.add_argument("--profile", action="store_true", help="measure the models on this machine and save them")
    p.add_argument("--simulate", action="store_true", help="plan and simulate a cluster from the saved profile")
    p.add_argument("--models", default=DEFAULT_MODELS, help="presets to profile (comma-separated)")
    p.add_argument("--profile-file", default=None, help="profile JSON (default CALID_HOME/placement/profile.json)")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Azure LLM trace CSV (lengths, and gaps without --cv)")
    p.add_argument("--devices", type=int, default=None, help="devices (default 16 simulated; live: this "
                   "machine's cores)")
    p.add_argument("--copies", type=int, default=None, help="independent copies of each profiled model (default 4 "
                   "simulated, 1 live)")
    p.add_argument("--device-memory", type=float, default=1.5,
                   help="each device's memory, in units of the largest model's weights (default 1.5)")
    p.add_argument("--cv", type=float, default=4.0, help="burstiness of each model's arrivals; 0: the trace's own gaps")
    p.add_argument("--load", type=float, default=0.6,
                   help="total request rate as a share of the pool's batch-1 capacity (default 0.6)")
    p.add_argument("--slo-scale", type=float, default=8.0,
                   help="SLO: a request's latency at most this many times its latency alone on one device "
                        "(default 8)")
    p.add_argument("--duration", type=float, default=None, help="seconds of arrivals (default 120 simulated, 60 "
                   "live)")
    p.add_argument("--live-plans", default="alpaserve,replication,dedicated",
                   help="live: the plans to serve and replay, in turn")
    p.add_argument("--port", type=int, default=50071, help="live: the gRPC port of the app served (loopback)")
    p.add_argument("--max-output", type=int, default=64, help="output tokens per request at most (default 64)")
    p.add_argument("--max-prompt", type=int, default=512, help="prompt tokens per request at most (default 512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp-efficiency", type=float, default=None,
                   help="what-if: a 2-way tensor split's efficiency instead of the measured one (1.0: perfect)")
    p.add_argument("--pp-overhead", type=float, default=None,
                   help="what-if: extra step time per added pipeline stage instead of the measured one")
    p.add_argument("--overlap", action="store_true",
                   help="what-if: pipelined steps of one model overlap (vLLM's virtual engines), which calid's "
                        "pipeline does not do (it cuts one step into micro-batches)")
    p.add_argument("--corun", type=float, default=None,
                   help="a device's step time with every other device busy / alone (default: live, the profile's "
                        "measure of this machine's cores; simulated, 1.0: independent devices such as GPUs)")
    p.add_argument("--plot", action="store_true", help="also sweep rate, CV and SLO scale and save a PNG")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the results")
    p.add_argument("--out", default="bench_results")
    p.set_defaults(func=lambda args: run(args, run_live))


def profile_path(arg: str | None) -> Path:
    from calid.paths import calid_home

    return Path(arg) if arg else calid_home() / "placement" / "profile.json"


# ---- measuring -------------------------------------------------------------------------------------------


def _timed_generate(engine, ids: list[list[int]], tokens: int) -> float:
    from calid.generation import GenerationRequest, SamplingParams

    start = time.perf_counter()
    engine.generate([GenerationRequest(list(i), SamplingParams(max_new_tokens=tokens, ignore_eos=True)) for i in ids])
    return time.perf_counter() - start


def _step_s(engine, ids: list[list[int]], tokens: int) -> float:
    """Seconds of one decode step of these sequences: ``tokens`` more steps timed, their first token's
    (the prefill's) time taken off."""
    return (_timed_generate(engine, ids, tokens + 1) - _timed_generate(engine, ids, 1)) / tokens


def measure_model(spec: str, tokens: int = 16, prompt_tokens: int = 128):
    """A model's one-device Latency (one thread), on the backend calid serves it with."""
    from calid.backends import open_model
    from calid.engine import Engine
    from calid.placement.profile import Latency

    m = open_model(spec, threads=1, show_progress=True)
    engine = Engine(m.runner, m.tokenizer, m.eos_ids, max_batch=max(BATCHES))
    prompt = [(7 * j) % 1000 + 5 for j in range(prompt_tokens)]
    _timed_generate(engine, [prompt[:8]], 2)  # warm-up
    steps = []
    for b in BATCHES:
        ids = [[(k + 11) % 997 + 3] + prompt[:8] for k in range(b)]  # short prompts: steps dominate
        steps.append(_step_s(engine, ids, tokens))
    first = _timed_generate(engine, [prompt], 1)
    prefill = max(first - steps[0], 0.0) / prompt_tokens
    return Latency(BATCHES, tuple(steps), prefill), m.decode_read_bytes


def _corun_job(spec: str, core: int, tokens: int, start, out) -> None:
    """One process: the model on one thread pinned to ``core``; after ``start`` (a barrier), its batch-1 decode
    step time goes to ``out``."""
    import os

    from calid.backends import open_model
    from calid.engine import Engine

    os.sched_setaffinity(0, {core})
    m = open_model(spec, threads=1, show_progress=False, log=lambda line: None)
    engine = Engine(m.runner, m.tokenizer, m.eos_ids, max_batch=1)
    prompt = [[(7 * j) % 1000 + 5 for j in range(8)]]
    _timed_generate(engine, prompt, 2)  # warm-up
    start.wait()
    out.put((core, _step_s(engine, prompt, tokens)))


def _corun_steps(spec: str, cores: list[int], tokens: int) -> list[float]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(len(cores)), ctx.Queue()
    procs = [ctx.Process(target=_corun_job, args=(spec, c, tokens, start, out), daemon=True) for c in cores]
    for p in procs:
        p.start()
    try:
        steps = [out.get(timeout=600)[1] for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
    return steps


def measure_corun(spec: str = "qwen2.5-coder-0.5b-instruct", tokens: int = 32, rounds: int = 2) -> tuple[float, dict]:
    """How much longer a one-thread decode step takes on core 0 when every core runs one too (each its own
    process, pinned): the devices' co-run slowdown (calid.placement.simulator). Rounds alternate alone and
    together; the ratio of their medians."""
    import os
    import statistics

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return 1.0, {"cores": len(cores)}
    alone, together = [], []
    for _ in range(rounds):
        alone += _corun_steps(spec, cores[:1], tokens)
        together += _corun_steps(spec, cores, tokens)
    ratio = max(1.0, statistics.median(together) / statistics.median(alone))
    return round(ratio, 3), {"alone_ms": round(1000 * statistics.median(alone), 1),
                             "together_ms": round(1000 * statistics.median(together), 1), "cores": len(cores)}


def measure_parallel_costs(model: str = "qwen2.5-coder-0.5b-instruct"):
    """TP and PP costs of a 2-way split (one process per core) against one process on one core."""
    from calid.bench.parallel import group_job
    from calid.models.source import resolve
    from calid.parallel.local_group import run_ranks
    from calid.placement.profile import ParallelCosts

    path = str(resolve(model).path)
    tok_s = {}
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        ranks = run_ranks(tp * pp, group_job, path, tp, pp, 1, "cpu", 24, 1, threads=1)
        tok_s[(tp, pp)] = ranks[0]["tok_s"]
        print(f"  {model} tp{tp}xpp{pp}: {tok_s[(tp, pp)]:.1f} tok/s", file=sys.stderr)
    tp_eff = tok_s[(2, 1)] / tok_s[(1, 1)] / 2
    pp_overhead = tok_s[(1, 1)] / tok_s[(1, 2)] - 1
    return ParallelCosts(round(min(max(tp_eff, 0.05), 1.0), 3), round(max(pp_overhead, 0.0), 3)), tok_s


def run_profile(args) -> int:
    from calid.backends import cpu_summary
    from calid.placement.profile import Config, ModelProfile, save

    specs = [s.strip() for s in args.models.split(",") if s.strip()]
    profiles = {}
    for n, spec in enumerate(specs, 1):
        print(f"[{n}/{len(specs) + 2}] {spec}: decode steps at batch {', '.join(map(str, BATCHES))}, prefill",
              file=sys.stderr)
        lat, weight_bytes = measure_model(spec)
        profiles[spec] = ModelProfile(spec, weight_bytes, {Config(1, 1): lat})
        print(f"  step ms {', '.join(f'b{b}={1000 * t:.1f}' for b, t in zip(lat.batches, lat.step_s))}; "
              f"prefill {1000 * lat.prefill_s_per_token:.2f} ms/token; weights {weight_bytes / 2**20:.0f} MiB",
              file=sys.stderr)
    print(f"[{len(specs) + 1}/{len(specs) + 2}] tensor and pipeline split costs", file=sys.stderr)
    costs, tok_s = measure_parallel_costs()
    print(f"[{len(specs) + 2}/{len(specs) + 2}] co-run: a device's step alone and with every core busy",
          file=sys.stderr)
    corun, corun_ms = measure_corun()
    print(f"  {corun_ms}: slowdown {corun}", file=sys.stderr)
    meta = {"cpu": cpu_summary(), "threads_per_device": 1, "tp_efficiency": costs.tp_efficiency,
            "pp_overhead": costs.pp_overhead, "split_tok_s": {f"tp{t}xpp{p}": v for (t, p), v in tok_s.items()},
            "corun_slowdown": corun, "corun_ms": corun_ms, "measured": time.strftime("%Y-%m-%d %H:%M")}
    path = profile_path(args.profile_file)
    save(path, profiles, meta)
    print(f"profile: {path}\n  tp efficiency {costs.tp_efficiency} (2-way), pp overhead {costs.pp_overhead} per stage; "
          f"{cpu_summary()}")
    return 0


# ---- planning and simulating -----------------------------------------------------------------------------


def trace_lengths(path: Path, most: int = 2000):
    """The trace's first requests (up to ``most``): the lengths a simulated workload takes."""
    from calid.placement.traffic import read_trace
    from calid.errors import CalidError

    if not path.is_file():
        raise CalidError(f"no trace at {path} (--trace: the Azure LLM trace CSV)")
    with open(path) as f:
        rows = sum(1 for _ in f) - 1
    if rows < 2:
        raise CalidError(f"{path} holds {max(rows, 0)} requests; a workload needs at least 2")
    return read_trace(path, min(rows, most))


def scenario(profiles, meta: dict, args, cv: float | None = None, load: float | None = None,
             slo_scale: float | None = None, configs: list[str] = SCALED_CONFIGS, corun: float = 1.0):
    """The Problem a run plans for: scaled profiles, per-model rates, Gamma (or trace) arrivals, SLOs."""
    from calid.placement.planner import LatencySlo, Problem
    from calid.placement.profile import Config, ParallelCosts, scaled
    from calid.placement.workload import workload

    cv = args.cv if cv is None else cv
    load = args.load if load is None else load
    slo_scale = args.slo_scale if slo_scale is None else slo_scale
    costs = ParallelCosts(meta["tp_efficiency"] if args.tp_efficiency is None else args.tp_efficiency,
                          meta["pp_overhead"] if args.pp_overhead is None else args.pp_overhead)
    models = scaled(profiles, costs, [Config.parse(c) for c in configs], copies=args.copies)
    lengths = trace_lengths(Path(args.trace))
    mean_out = sum(min(r.output_tokens, args.max_output) for r in lengths) / len(lengths)
    mean_prompt = sum(min(r.prompt_tokens, args.max_prompt) for r in lengths) / len(lengths)
    # the pool's batch-1 capacity: devices / mean seconds of a request alone, the models' traffic equal
    alone = [p.alone_latency_s(round(mean_prompt), mean_out) for p in models.values()]
    capacity = args.devices / (sum(alone) / len(alone))
    rate = load * capacity / len(models)
    requests = workload({m: rate for m in models}, args.duration, lengths, cv or None, args.seed,
                        args.max_prompt, args.max_output)
    slos = {m: LatencySlo(slo_scale, p) for m, p in models.items()}
    biggest = max(p.weight_bytes for p in models.values())
    corun = corun if args.corun is None else args.corun
    return (Problem(models, args.devices, biggest * args.device_memory, requests, slos, overlap=args.overlap,
                    corun=corun), rate * len(models))


def plan_all(problem, log=None) -> dict:
    """Every planner's plan; ``log``: told as each starts and ends (planning can take minutes)."""
    from calid.placement.planner import PLANNERS, unplaced

    plans = {}
    for name in PLANNER_ORDER:
        if log:
            log(f"planning: {name} ...")
        plans[name] = plan = PLANNERS[name](problem)
        if log:
            left = unplaced(problem, plan.placement)
            log(f"planning: {name} done in {plan.seconds:.1f} s ({plan.simulations} simulations); models without "
                f"a replica: {', '.join(left) or 'none'}")
    return plans


def _sweep(profiles, meta, args, key: str, values: list[float]) -> list[dict]:
    rows = []
    for v in values:
        problem, _ = scenario(profiles, meta, args, **{key: v})
        plans = plan_all(problem)
        rows.append({key: v, **{n: p.attainment for n, p in plans.items()}})
        print(f"  {key}={v:g}: " + ", ".join(f"{n} {p.attainment:.3f}" for n, p in plans.items()), file=sys.stderr)
    return rows


def run_simulate(args) -> int:
    from calid.bench.plot import attainment_views
    from calid.bench.report import write_report
    from calid.errors import CalidError
    from calid.placement.profile import load

    path = profile_path(args.profile_file)
    if not path.exists():
        raise CalidError(f"no placement profile at {path}: measure one first with calid bench placement --profile")
    if args.devices < 1 or args.copies < 1 or args.duration <= 0 or args.load <= 0 or args.slo_scale <= 0:
        raise CalidError("--devices, --copies, --duration, --load and --slo-scale must be > 0")
    profiles, meta = load(path)
    problem, rate = scenario(profiles, meta, args)
    print(
        f"bench placement: {len(problem.profiles)} models ({args.copies} copies of {', '.join(profiles)}) on "
        f"{args.devices} devices of {problem.device_memory / 2**30:.2f} GiB; {len(problem.requests)} requests "
        f"over {args.duration:g} s at {rate:.2f} req/s (load {args.load:g}), CV {args.cv or 'trace'}, "
        f"SLO scale {args.slo_scale:g}{'; what-if: overlapping pipelined steps' if args.overlap else ''}; "
        f"co-run slowdown {problem.corun:g}{' (independent devices)' if problem.corun == 1.0 else ''}; "
        f"split costs: tp efficiency {args.tp_efficiency if args.tp_efficiency is not None else meta['tp_efficiency']}"
        f"{'' if args.tp_efficiency is None else ' (what-if)'}, pp overhead "
        f"{args.pp_overhead if args.pp_overhead is not None else meta['pp_overhead']}"
        f"{'' if args.pp_overhead is None else ' (what-if)'}; "
        f"profile measured on {meta.get('cpu', '?')}",
        file=sys.stderr,
    )
    plans = plan_all(problem, log=lambda line: print(line, file=sys.stderr, flush=True))
    rows = [{"planner": n, "slo_attainment": p.attainment, "simulations": p.simulations,
             "plan_seconds": p.seconds, "placement": str(p.placement)} for n, p in plans.items()]
    for r in rows:
        print(f"{r['planner']:>12}: attainment {r['slo_attainment']:.3f}  ({r['simulations']} simulations, "
              f"{r['plan_seconds']:.1f} s)  {r['placement']}")
    best = plans["alpaserve"].attainment
    print("alpaserve / replication: " + _ratio(best, plans["replication"].attainment) +
          "; alpaserve / dedicated: " + _ratio(best, plans["dedicated"].attainment))
    sweeps = {}
    out = Path(args.out)
    if args.plot:
        print("sweeps (each point planned afresh):", file=sys.stderr)
        sweeps = {"load": _sweep(profiles, meta, args, "load", [0.2, 0.4, 0.6, 0.8, 1.0]),
                  "cv": _sweep(profiles, meta, args, "cv", [0.5, 1, 2, 4, 6]),
                  "slo_scale": _sweep(profiles, meta, args, "slo_scale", [2, 4, 8, 16, 32])}
        png = attainment_views(sweeps, out / "placement.png")
        print(f"plot: {png}")
    meta_out = {"devices": args.devices, "models": len(problem.profiles), "requests": len(problem.requests),
                "rate_rps": rate, "cv": args.cv or "trace", "slo_scale": args.slo_scale, "overlap": args.overlap,
                "corun": problem.corun,
                "tp_efficiency_what_if": args.tp_efficiency, "pp_overhead_what_if": args.pp_overhead,
                "profile": str(path),
                **{f"profile_{k}": v for k, v in meta.items()}}
    js, md = write_report(out, "placement", "AlpaServe placement vs replication and dedicated (simulated)",
                          meta_out, rows, ["planner", "slo_attainment", "simulations", "plan_seconds", "placement"],
                          ["attainment: share of requests whose latency is within SLO scale x their latency "
                           "alone on one device, by the simulator",
                           "replication: one-device groups, greedy replicas; dedicated: devices per model by load"])
    print(f"report: {js} and {md}")
    if args.json:
        print(json.dumps({"slo_attainment": {n: p.attainment for n, p in plans.items()},
                          "per_model": {n: p.per_model for n, p in plans.items()},
                          "plan_seconds": {n: p.seconds for n, p in plans.items()}, "sweeps": sweeps,
                          "meta": meta_out}))
    return 0


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else ("inf" if a > 0 else "n/a")


def run(args, run_live=None) -> int:
    from calid.errors import CalidError

    if args.corun is not None and args.corun < 1.0:
        raise CalidError(f"--corun is a slowdown, at least 1.0 (got {args.corun:g})")
    live = not args.simulate and not args.profile
    defaults = {"devices": None if live else 16, "copies": 1 if live else 4, "duration": 60.0 if live else 120.0}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.profile:
        run_profile(args)
        if not args.simulate:
            return 0
    if args.simulate:
        return run_simulate(args)
    if run_live is None:
        raise CalidError("a live placement run serves the models: run it through the calid command")
    return run_live(args)
