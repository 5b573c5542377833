"""``calid bench placement`` without ``--simulate``: a placement planned from the measured profile, applied as
a multi-model calid app on this machine, a short trace replayed through gRPC, and the measured SLO attainment
printed beside the simulator's prediction for the same requests.

Devices are this machine's cores (the profile timed each model on one thread): a plan's group of devices
becomes a set of cores, and every model the group hosts runs as a target replica pinned to them
(ModelSpec.placement), target-only (ar: the profile timed the target alone). Requests go to the group with
the fewest in flight, as the simulator dispatches them. Only one-device groups (tp1xpp1) are applied live:
calid's TP/PP groups are torch shard actors that a core set does not pin yet, and on this CPU a split does
not pay (the profile's split costs), so the planners choose none at this size.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from calid.errors import CalidError

APP = "placement"
WARM_TOKENS = 4
PROBES, PROBE_TOKENS = 2, 24  # lone requests per model that time the serving path's step


def add_parser(sub) -> None:
    from calid.bench import placement

    placement.add_parser(sub, run_live=run)


def run(args) -> int:
    """The live run of ``calid bench placement``: plan for this machine's cores, serve, replay, compare."""
    from calid.backends import cpu_summary
    from calid.bench.placement import PLANNER_ORDER, profile_path, scenario
    from calid.placement.profile import load

    path = profile_path(args.profile_file)
    if not path.exists():
        raise CalidError(f"no placement profile at {path}: measure one first with calid bench placement --profile")
    available = cores()
    args.devices = args.devices or len(available)
    if not 1 <= args.devices <= len(available):
        raise CalidError(f"--devices {args.devices}: live runs use this machine's cores ({len(available)})")
    wanted = [p.strip() for p in args.live_plans.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in PLANNER_ORDER]
    if unknown or not wanted:
        raise CalidError(f"--live-plans among {', '.join(PLANNER_ORDER)}, got {args.live_plans!r}")
    args.live_plans = wanted
    profiles, meta = load(path)
    # live: one-device groups, on cores that slow each other down as the profile measured
    problem, rate = scenario(profiles, meta, args, configs=["tp1xpp1"], corun=meta.get("corun_slowdown", 1.0))
    print(f"bench placement (live): {len(problem.profiles)} models ({', '.join(problem.profiles)}) on "
          f"{args.devices} cores; {len(problem.requests)} requests over {args.duration:g} s at {rate:.2f} req/s "
          f"(load {args.load:g}), CV {args.cv or 'trace'}, SLO scale {args.slo_scale:g}, co-run slowdown "
          f"{problem.corun:g}; profile {path} "
          f"({meta.get('cpu', '?')}); now {cpu_summary()}", file=sys.stderr)
    from calid.placement.planner import PLANNERS

    plans = {}
    for name in args.live_plans:
        try:
            plans[name] = PLANNERS[name](problem)
        except ValueError as e:  # e.g. dedicated: fewer devices than models
            print(f"[live] {name}: no plan: {e}", file=sys.stderr)
    args.live_plans = [n for n in args.live_plans if n in plans]
    if not plans:
        raise CalidError("no planner could place these models on these devices")
    rows = run_live(args, problem, plans, problem.profiles, args.port)
    meta_out = {"devices": args.devices, "requests": len(problem.requests), "rate_rps": rate, "cv": args.cv or "trace",
                "corun": problem.corun,
                "slo_scale": args.slo_scale, "duration_s": args.duration, "profile": str(path), "cpu": cpu_summary()}
    report(args, rows, meta_out)
    if args.json:
        print(json.dumps({"live": rows, "meta": meta_out}))
    return 0


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def plan_to_models(placement, profiles: dict, available: list[int], max_batch: int) -> list[dict]:
    """The ModelSpec dicts that serve ``placement`` on ``available`` cores: group i takes the next
    ``devices`` cores; a model's placement lists the cores of every group hosting it."""
    needed = sum(g.config.devices for g in placement.groups)
    if needed > len(available):
        raise CalidError(f"the plan uses {needed} devices and this machine has {len(available)} cores")
    hosts: dict[str, list[list[int]]] = {}
    at = 0
    for g in placement.groups:
        if (g.config.tp, g.config.pp) != (1, 1):
            raise CalidError(f"live placement applies one-device groups only; this plan has a {g.config} group")
        group_cores = available[at:at + g.config.devices]
        at += g.config.devices
        for m in g.models:
            hosts.setdefault(m, []).append(group_cores)
    return [{"name": _name(m), "target": m, "draft": None, "default_mode": "ar", "placement": hosts[m],
             "max_active": max_batch} for m in profiles if m in hosts]


def _name(model: str) -> str:
    """A served name for a profile's model spec (a preset name already is one)."""
    from calid.models.source import served_name

    return served_name(model)


def prompts_for(requests, tokenizer) -> list[str]:
    from calid.placement import traffic as load
    from calid.bench.data import humaneval_prompts

    corpus = tokenizer("\n\n".join(humaneval_prompts()), add_special_tokens=False)["input_ids"]
    return [tokenizer.decode(ids) for ids in load.cut_prompts(corpus, [r.prompt_tokens for r in requests])]


async def replay(address: str, requests, prompts: list[str]) -> list:
    """Send each request at its arrival time (streamed, EOS ignored, raw prompt) and record what the client
    saw; times are relative to the replay's start, like the simulator's."""
    from calid.placement.traffic import Outcome
    from calid.client import AsyncClient
    from serve_app.bench.load import _one

    async with AsyncClient(address, app=APP, timeout=1800, retries=0) as c:
        start = time.perf_counter()

        async def at(r, prompt):
            await asyncio.sleep(max(0.0, start + r.at_s - time.perf_counter()))
            o = await _one(c, prompt, "ar", r.output_tokens, model=_name(r.model), raw_prompt=True)
            return Outcome(o.sent_s - start, o.first_s and o.first_s - start, o.last_s and o.last_s - start,
                           o.tokens, o.error)

        return list(await asyncio.gather(*(at(r, p) for r, p in zip(requests, prompts))))


async def warm(address: str, models: list[str], prompt: str) -> None:
    """One short request per model replica group, so that no replayed request pays for a first call."""
    from calid.client import AsyncClient

    async with AsyncClient(address, app=APP, timeout=900) as c:
        await asyncio.gather(*(c.generate(prompt, model=m, max_new_tokens=WARM_TOKENS, ignore_eos=True, mode="ar")
                               for m in models for _ in range(2)))


async def served_step_s(address: str, models: dict[str, str], prompt: str) -> dict[str, float]:
    """Each model's time per output token through the served app, one request alone (the fastest of
    PROBES): profile model name -> seconds."""
    from calid.client import AsyncClient
    from serve_app.bench.load import _one

    out = {}
    async with AsyncClient(address, app=APP, timeout=900) as c:
        for model, served in models.items():
            best = float("inf")
            for _ in range(PROBES):
                o = await _one(c, prompt, "ar", PROBE_TOKENS, model=served, raw_prompt=True)
                if o.error is None and o.tokens > 1:
                    best = min(best, (o.last_s - o.first_s) / (o.tokens - 1))
            out[model] = best
    return out


def run_live(args, problem, plans: dict, profiles: dict, port: int) -> list[dict]:
    """Serve each of ``args.live_plans`` in turn and replay ``problem``'s requests against it."""
    from calid.backends import model_facts
    from calid.models.loader import load_tokenizer
    from calid.placement.planner import attainment, attainment_of
    from calid.placement.profile import Config, with_overhead
    from calid.placement.simulator import simulate

    ONE = Config(1, 1)
    from serve_app.cluster.config import AppConfig
    from serve_app.cluster.local import serve_app, shutdown

    import ray
    from ray import serve

    _, folder = model_facts(next(iter(profiles)), "auto", "cpu", False, show_progress=False)
    prompts = prompts_for(problem.requests, load_tokenizer(folder))  # the same prompts for every plan
    rows = []
    owned = not ray.is_initialized()  # a Ray started here is shut down here; a running one only loses the app
    try:
        for name in args.live_plans:
            plan = plans[name]
            models = plan_to_models(plan.placement, profiles, cores(), problem.max_batch)
            cfg = AppConfig(app_name=APP, grpc_port=port, http_port=0, kv_budget_mb=512, queue_capacity=1024,
                            draft=None, models=models)
            print(f"[live] {name}: {plan.placement} -> " + "; ".join(f"{m['name']} on cores {m['placement']}"
                                                                   for m in models), file=sys.stderr)
            serve_app(cfg, dashboard=False)
            address = f"127.0.0.1:{port}"
            asyncio.run(warm(address, [m["name"] for m in models], prompts[0]))
            served = asyncio.run(served_step_s(address, {m["target"]: m["name"] for m in models}, prompts[0][:64]))
            overhead = {m: max(0.0, t - profiles[m].latency[ONE].step(1)) for m, t in served.items()}
            t = time.perf_counter()
            outcomes = asyncio.run(replay(address, problem.requests, prompts))
            wall = time.perf_counter() - t
            live, live_per = attainment_of(problem, outcomes)
            sim, sim_per = attainment(problem, plan.placement)
            # the same prediction with each model's steps as long as they were through the served app alone
            served_problem = replace(problem, profiles=with_overhead(problem.profiles, overhead))
            predicted = simulate(plan.placement, served_problem.profiles, problem.requests, problem.max_batch,
                                 problem.overlap, problem.corun)
            sim_s, sim_s_per = attainment_of(served_problem, predicted)
            _save_outcomes(Path(args.out) / f"placement-live-{name}.jsonl", problem, outcomes, predicted)
            errors = sum(o.error is not None for o in outcomes)
            rows.append({"planner": name, "placement": str(plan.placement), "simulated": sim,
                         "simulated_served": sim_s, "measured": live, "difference_points": 100 * (live - sim_s),
                         "requests": len(outcomes), "errors": errors, "replay_s": wall,
                         "step_overhead_ms": {m: round(1000 * v, 1) for m, v in overhead.items()},
                         "per_model": {m: {"simulated": sim_per.get(m), "simulated_served": sim_s_per.get(m),
                                           "measured": live_per.get(m)} for m in live_per}})
            print(f"[live] {name}: simulated {sim:.3f} (profile as measured), {sim_s:.3f} (with the serving "
                  f"path's step overhead measured alone: "
                  + ", ".join(f"{m} +{1000 * v:.1f} ms" for m, v in overhead.items())
                  + f"), measured {live:.3f} ({100 * (live - sim_s):+.1f} points; {len(outcomes)} requests in "
                  f"{wall:.0f} s, {errors} errors)", file=sys.stderr)
            serve.delete(APP)
    finally:
        if owned:
            shutdown()
        elif APP in serve.status().applications:
            serve.delete(APP)
    return rows


def _save_outcomes(path: Path, problem, live: list, simulated: list) -> None:
    """Each request's arrival, lengths, and latency live and simulated (seconds): what a gap is made of."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r, a, b in zip(problem.requests, live, simulated):
            f.write(json.dumps({"at_s": r.at_s, "model": r.model, "prompt": r.prompt_tokens, "output": r.output_tokens,
                                "alone_s": problem.slos[r.model].profile.alone_latency_s(r.prompt_tokens,
                                                                                         r.output_tokens),
                                "live_ttft_s": a.ttft_s, "live_s": a.last_s - a.sent_s if a.last_s else None,
                                "sim_ttft_s": b.ttft_s, "sim_s": b.last_s - b.sent_s if b.last_s else None,
                                "error": a.error}) + "\n")


def report(args, rows: list[dict], meta: dict) -> None:
    from calid.bench.report import write_report

    notes = ["simulated: the discrete-event simulator's attainment for the same requests and placement, from the "
             "profile as measured (the model in process); simulated_served: the same with each model's step longer "
             "by what the served app added to a lone request's time per token (measured before the replay); "
             "measured: the same requests replayed through gRPC against the placement served on this machine's "
             "cores; difference_points: measured - simulated_served",
             "attainment: share of requests whose end-to-end latency (client side) is within SLO scale x their "
             "latency alone on one device (the profile)"]
    table = [{k: v for k, v in r.items() if k != "per_model"} for r in rows]
    js, md = write_report(Path(args.out), "placement-live", "placement: simulator vs live", meta, table,
                          ["planner", "placement", "simulated", "simulated_served", "measured", "difference_points",
                           "requests", "errors", "replay_s"], notes)
    print(md.read_text())
    print(f"report: {js} and {md}", file=sys.stderr)
