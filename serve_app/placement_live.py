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
import os
import sys
import time
from pathlib import Path

from calid.errors import CalidError

APP = "placement"
WARM_TOKENS = 4


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
    from calid.bench import load
    from calid.bench.data import humaneval_prompts

    corpus = tokenizer("\n\n".join(humaneval_prompts()), add_special_tokens=False)["input_ids"]
    return [tokenizer.decode(ids) for ids in load.cut_prompts(corpus, [r.prompt_tokens for r in requests])]


async def replay(address: str, requests, prompts: list[str]) -> list:
    """Send each request at its arrival time (streamed, EOS ignored, raw prompt) and record what the client
    saw; times are relative to the replay's start, like the simulator's."""
    from calid.bench.load import Outcome
    from calid.client import AsyncClient
    from serve_app.load_bench import _one

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


def run_live(args, problem, plans: dict, profiles: dict, port: int) -> list[dict]:
    """Serve each of ``args.live_plans`` in turn and replay ``problem``'s requests against it."""
    from calid.backends import model_facts
    from calid.models.loader import load_tokenizer
    from calid.placement.planner import attainment, attainment_of
    from serve_app.config import AppConfig
    from serve_app.local import serve_app, shutdown

    import ray
    from ray import serve

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
            first = next(iter(profiles))
            _, folder = model_facts(first, "auto", "cpu", False, show_progress=False)
            prompts = prompts_for(problem.requests, load_tokenizer(folder))
            asyncio.run(warm(address, [m["name"] for m in models], prompts[0]))
            t = time.perf_counter()
            outcomes = asyncio.run(replay(address, problem.requests, prompts))
            wall = time.perf_counter() - t
            live, live_per = attainment_of(problem, outcomes)
            sim, sim_per = attainment(problem, plan.placement)
            errors = sum(o.error is not None for o in outcomes)
            rows.append({"planner": name, "placement": str(plan.placement), "simulated": sim, "measured": live,
                         "difference_points": 100 * (live - sim), "requests": len(outcomes), "errors": errors,
                         "replay_s": wall, "per_model": {m: {"simulated": sim_per.get(m), "measured": live_per.get(m)}
                                                         for m in live_per}})
            print(f"[live] {name}: simulated {sim:.3f}, measured {live:.3f} ({100 * (live - sim):+.1f} points; "
                  f"{len(outcomes)} requests in {wall:.0f} s, {errors} errors)", file=sys.stderr)
            serve.delete(APP)
    finally:
        if owned:
            shutdown()
        elif APP in serve.status().applications:
            serve.delete(APP)
    return rows


def report(args, rows: list[dict], meta: dict) -> None:
    from calid.bench.report import write_report

    notes = ["simulated: the discrete-event simulator's attainment for the same requests and placement; measured: "
             "the same requests replayed through gRPC against the placement served on this machine's cores",
             "attainment: share of requests whose end-to-end latency (client side) is within SLO scale x their "
             "latency alone on one device (the profile)"]
    table = [{k: v for k, v in r.items() if k != "per_model"} for r in rows]
    js, md = write_report(Path(args.out), "placement-live", "placement: simulator vs live", meta, table,
                          ["planner", "placement", "simulated", "measured", "difference_points", "requests",
                           "errors", "replay_s"], notes)
    print(md.read_text())
    print(f"report: {js} and {md}", file=sys.stderr)
