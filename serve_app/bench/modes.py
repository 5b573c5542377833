"""``calid bench modes``: does any mode the server chooses lose to plain decoding, served or in process?

Side by side in one run, same prompts through the chat template, greedy, each answer to its EOS (at most
``--max-new-tokens``: users' requests stop there; ``--ignore-eos`` is the stress case, labelled as such, where the
model repeats itself past its answer and n-gram drafts copy it): for each workload,
concurrency C and mode, the same ``--requests`` prompts in waves of C requests (each wave a burst, as a closed loop
of C clients sends them: one request at C=1 is a single noisy reading) through gRPC + Ray Serve and through the
in-process ``Engine`` (batch C), alternating which goes first, repeated ``--rounds`` times, the modes in
reverse order every other round (the median counts: the machine is shared and noisy, and drifts). Workloads
(calid.bench.data.workload_prompts):
  mix        the default: the three below in turn, as a server's users send them;
  humaneval  "complete this function" prompts: free-form generation, little to copy;
  grounded   refactors of HumanEval's reference functions and summaries of XSum articles that quote
             them: answers that copy their input, where n-gram drafts cost no model time;
  chat       MT-bench's first turns: open questions (writing, reasoning, STEM, roleplay, ...).
Printed per point: tokens/s served and in process, the ratio to ar at the same point (whole requests, prefill
included), the served time per output token after the first and its ratio to ar's (decoding alone, what
drafting can speed up), the most any mode could gain on whole requests if decoding cost nothing
(prefill_cap), served/in-process, what serving adds per router step (the router's step time less the
workers' forward time, from the server's own counters), the share of tokens that came from drafts, and
greedy agreement with ar. Beside them: the CPU flags, the bandwidth limit of one decode step, and
filter's physical cap at each C (even if the draft made every token and the target were never asked, each
token costs a draft step: filter cannot beat ar by more than ar's cost per token / the draft's, decoding
alone), and per workload the n-gram bound: what an oracle that knew which copied tokens ar confirms would
gain at one request with the timed forward costs (calid.bench.ngram_bound), the ceiling for auto's n-gram
drafts; and per workload and concurrency the planner replay: ar's greedy outputs of the burst decoded again as
auto's planner chooses n-gram copies, timed by the same costs (calid.bench.plan_replay): what the planner's
choices gain on decoding without this machine's noise, beside what the served run measured.
"""
from __future__ import annotations

import asyncio
import copy
import functools
import operator
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from calid.bench.data import WORKLOADS
from serve_app.cluster.config import add_topology_arg

SERVED_VS_INPROC = 0.95  # the goal: serving costs at most 5% of what the engine does in process
COLUMNS = ["workload", "concurrency", "mode", "served_tok_s", "served_vs_ar", "rounds_vs_ar", "tpot_ms", "decode_vs_ar",
           "prefill_cap", "inproc_tok_s", "inproc_vs_ar", "served_vs_inproc", "serving_ms_per_step", "nonforward_ms",
           "worker_ms", "inproc_nonforward_ms", "forward_ms", "inproc_forward_ms", "inproc_plan_ms", "draft_share",
           "guard_plain", "same_as_ar", "filter_cap", "filter_cap_whole"]


def add_parser(sub) -> None:
    p = sub.add_parser("modes", help="ar vs auto vs filter (and more) per concurrency, served beside in-process")
    p.add_argument("--small", action="store_true", help="SmolLM2-135M with self:16 instead of the Qwen pair")
    p.add_argument("--modes", default="ar,auto,filter", help="comma-separated modes (ar always runs)")
    p.add_argument("--concurrency", default="1,4,12", help="comma-separated burst sizes")
    p.add_argument("--workloads", default="mix", help=f"comma-separated among {', '.join(WORKLOADS)} (default mix: "
                   "code to write, text to edit or summarize, and open chat, in turn)")
    p.add_argument("--rounds", type=int, default=2, help="repeats of every point (median reported)")
    p.add_argument("--requests", type=int, default=8, help="prompts every point runs, in waves of its concurrency "
                   "(default 8; at least the highest concurrency)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="at most this many tokens an answer (default 96); "
                   "answers end at EOS, as users' requests do")
    p.add_argument("--ignore-eos", action="store_true", help="stress case, labelled as such in the table: every "
                   "answer runs to --max-new-tokens past EOS (the model then repeats itself, which flatters n-gram "
                   "drafts)")
    p.add_argument("--no-inproc", action="store_true", help="serve only (skip the in-process engine)")
    p.add_argument("--batch-invariant", choices=("on", "off"), default=None, help="override the app config's "
                   "batch_invariant (llama.cpp: exact forwards of at most 3 rows a call)")
    add_topology_arg(p)
    p.add_argument("--plain-run-ms", type=float, default=None, help="override the app config's plain_run_ms (0: "
                   "one target step per call, to measure what runs of plain steps save)")
    p.add_argument("--port", type=int, default=50066)
    p.add_argument("--out", default="bench_results")
    p.set_defaults(func=run)


def _options(args):
    from calid.bench.report import parse_numbers
    from calid.decoding.modes import MODES
    from calid.errors import CalidError

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    sweep = parse_numbers(args.concurrency, int)
    if any(m not in MODES for m in modes) or any(w not in WORKLOADS for w in workloads) or not workloads:
        raise CalidError(f"--modes takes modes among {', '.join(MODES)}; --workloads among {', '.join(WORKLOADS)}")
    if not sweep or min(sweep) < 1 or args.rounds < 1 or args.max_new_tokens < 2 or args.requests < 1:
        raise CalidError("--concurrency takes counts >= 1, --rounds >= 1, --requests >= 1, --max-new-tokens >= 2")
    return ["ar"] + [m for m in modes if m != "ar"], workloads, sorted(set(sweep))


NOTES = [  # how to read the table's columns (the report adds the decode limit after these)
    "served_vs_ar / inproc_vs_ar: tokens/s relative to ar at the same workload and concurrency (median of rounds)",
    "rounds_vs_ar: served tokens/s of each round over ar's in the same round (minutes apart): the spread of one "
    "reading on this machine",
    "tpot_ms / decode_vs_ar: the server's mean time per output token after a request's first (from its own "
    "ttft and total times), and ar's over this mode's: decoding alone, what drafting speeds up",
    "prefill_cap: ar's time / the time each wave's last request got its first token, summed: what any mode could gain "
    "over ar on whole requests if decoding cost nothing (exact at one request; under load prefill shares "
    "steps with decoding, so the cap is lower than the truth)",
    "served_vs_inproc: served tokens/s / in-process tokens/s for the same requests (1.0 = serving costs nothing)",
    "serving_ms_per_step: (router step time - workers' forward time) / router steps: transport and router work",
    "nonforward_ms / inproc_nonforward_ms: the steps' time less the models' own forwards (llama_decode; the torch "
    "model's call), per forward of the target, served (router steps) and in process: all that calid adds around "
    "a decoding step's forward (goal < 1 ms at c1; a router step that runs several plain steps in the worker is "
    "one step but several forwards); inproc_plan_ms: of which the auto planner's, per step",
    "worker_ms: of nonforward_ms, the workers' side (their calls' time less the models' forwards): the hop to the "
    "thread that runs the forwards and back (a thread's wake-up each way), the verify call's own work, reading "
    "the rows' argmax; the rest of nonforward_ms is the router's (planning, bookkeeping, delivery)",
    "forward_ms / inproc_forward_ms: the target's own time per forward (llama_decode), served and in process: "
    "the same forwards run slower served where the serving processes take cores from llama.cpp's threads",
    "draft_share: output tokens that came from drafts (a draft model's, or n-gram copies of the request's own "
    "tokens) / all output tokens",
    "guard_plain: served steps the router's StepGuard ran plain: those whose plan drafted but whose forecast, "
    "corrected by how forecasts of its size and depth held, did not beat a plain step's, and those it did not let "
    "the planner price, where this batch size's drafting steps measurably saved no more than its plain ones "
    "(calid.planning.StepGuard)",
    "same_as_ar: greedy outputs identical to ar's token for token (lossless modes must match)",
    "filter_cap: ar's cost per token at this batch / (the draft's + the target's reading a token at its cheapest: "
    "catching up on gamma (8) tokens a sequence, or at its prefill rate), timed on the in-process runners: the most "
    "filter can gain in decoding here, if the draft made every token and the target only read them into its cache "
    "(calid.calibration.filter_cap)",
    "filter_cap_whole: filter_cap on whole requests: ar's prefill (1 / prefill_cap of its time) stays, and filter's "
    "draft prefills every prompt too, in the time timed beside filter_cap (calid.calibration.whole_request_cap); "
    "exact at one request, under load an estimate (prefill_cap is lower than the truth there)",
    "verification cap: max over forward sizes k of k x cost(1) / cost(k), timed in process: what lossless "
    "drafting could gain at one request if every draft token were accepted and drafts cost nothing "
    "(calid.calibration.verification_cap); under load, less",
    "ngram_bound: the most any planner of n-gram drafts gains at one request on this workload: an oracle "
    "replays ar's outputs through each request's n-gram index and verifies exactly the proposed tokens ar "
    "confirms, as long a prefix as pays at the timed forward costs (calid.bench.ngram_bound); under load, less",
    "planner_replay: ar's greedy outputs of each burst decoded again, step by step, as auto's planner chooses "
    "n-gram copies (no StepGuard, no draft model, no Lookahead), every step timed by the same forward costs as "
    "the target slices the batch (calid.bench.plan_replay): the planner's decoding speed-up without this "
    "machine's noise, to read beside decode_vs_ar",
    "planner_foresight: the same replay with the planner told exactly how many tokens of each copy ar's output "
    "confirms: what auto's n-gram copies could reach at this load if their yields were known (replay against it: "
    "what guessing them costs); the verdict turns it into whole requests past the prefill",
]


def run(args) -> int:
    from calid.backends import cpu_summary
    from calid.bench.report import write_report

    modes, workloads, sweep = _options(args)
    setup = _Setup(args, max(sweep), workloads)
    setup.announce(modes, workloads, sweep)
    spec_cap = setup.calibrate() if "auto" in modes else None
    samples, caps = _measure(args, setup, modes, workloads, sweep)
    bounds, replays, foresights = _oracles(setup, samples, workloads, sweep) if spec_cap else ({}, {}, {})
    cfg, lengths = setup.cfg, setup.lengths
    rows = _rows(samples, caps)
    meta = {"target": cfg.target, "draft": cfg.draft, "batch_invariant": cfg.batch_invariant,
            "plain_run_ms": cfg.plain_run_ms,
            "new_tokens": _lengths_text(lengths, workloads), "rounds": args.rounds,
            "cpu": cpu_summary(), "bandwidth_GBps": round(setup.bandwidth, 1),
            "decode_limit_tok_s": round(setup.limit, 1),
            "verification_cap": None if spec_cap is None else f"{spec_cap[0]:.2f}x at {spec_cap[1]} tokens",
            "ngram_bound": {w: f"{b.ratio:.2f}x ({b.copied}/{b.tokens} tokens copied)" for w, b in bounds.items()},
            "planner_replay": {f"{w} c{c}": r.describe() for (w, c), r in replays.items()},
            "planner_foresight": {f"{w} c{c}": r.describe() for (w, c), r in foresights.items()}}
    bandwidth, target = setup.bandwidth, setup.target
    notes = NOTES + [
        f"decode limit: bandwidth {bandwidth:.1f} GB/s / {target.decode_read_bytes / 1e9:.2f} GB of target weights per "
        "step",
    ]
    name = f"modes-{'small' if args.small else 'qwen'}-{'invariant' if cfg.batch_invariant else 'batched'}"
    js, md = write_report(Path(args.out), name, "the server's choices vs plain decoding, served and in process",
                          meta, rows, COLUMNS, notes)
    print(md.read_text())
    print(_verdict(rows, modes, bounds, replays, foresights), file=sys.stderr)
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0


class _Setup:
    """The models opened once for the whole run (in-process engine beside the served app), the prompts, and
    this machine's decode limit."""

    def __init__(self, args, top: int, workloads: list[str]):
        from calid.backends import open_draft, open_model
        from calid.bench.data import workload_prompts
        from calid.bench.hardware import decode_limit_tok_s, memory_bandwidth_gbs
        from calid.engine import Engine
        from serve_app.cluster.config import AppConfig, with_plain_run_ms

        base = AppConfig.small if args.small else AppConfig
        # every mode runs the same prompts: no prompt cache, or each point after the first would skip its prefill
        cfg = base(grpc_port=args.port, http_port=0, max_active=top, queue_capacity=max(64, top), prompt_cache=False,
                   topology=args.topology)
        if args.batch_invariant is not None:
            cfg = cfg.model_copy(update={"batch_invariant": args.batch_invariant == "on"})
        self.cfg = cfg = with_plain_run_ms(cfg, args.plain_run_ms)
        self.target = open_model(cfg.target, cfg.target_backend, cfg.dtype, invariant=cfg.batch_invariant,
                                 prompt_cache=cfg.prompt_cache, prefill_weights=cfg.prefill_weights)
        draft = open_draft(cfg.draft, self.target, cfg.draft_backend, cfg.dtype, invariant=cfg.batch_invariant,
                           prompt_cache=cfg.prompt_cache, weights=cfg.draft_weights,
                           prefill_weights=cfg.prefill_weights)
        self.engine = None if args.no_inproc else Engine(
            self.target.runner, self.target.tokenizer, self.target.eos_ids, draft=draft.runner, max_batch=top,
            max_forward_tokens=cfg.max_forward_tokens)
        self.top = top
        self.requests = max(top, args.requests)  # prompts every point runs, in waves of its concurrency
        self.texts = {w: workload_prompts(w, self.requests) for w in workloads}
        # per workload: at most how many tokens, and whether EOS ends an answer
        self.lengths = {w: (args.max_new_tokens, not args.ignore_eos) for w in WORKLOADS}
        self.rounds = args.rounds
        self.bandwidth = memory_bandwidth_gbs()
        self.limit = decode_limit_tok_s(self.bandwidth, self.target.decode_read_bytes)
        self.calibrated = None

    def announce(self, modes, workloads, sweep) -> None:
        from calid.backends import cpu_summary

        cfg = self.cfg
        print(f"bench modes: target {cfg.target}, draft {cfg.draft}; modes {modes}; concurrency {sweep}; workloads "
              f"{workloads}; {self.rounds} rounds; {_lengths_text(self.lengths, workloads)}, greedy; "
              f"{cpu_summary()}; bandwidth {self.bandwidth:.1f} GB/s -> one decode step >= "
              f"{1000 / self.limit:.1f} ms ({self.limit:.1f} tok/s at batch 1)", file=sys.stderr)

    def calibrate(self):
        """The in-process engine's cost table (as the served app's warm-up calibrates its router: not inside a
        timed point), and the verification cap it implies; None without an in-process engine."""
        from calid.calibration import verification_cap

        if self.engine is None:
            return None
        self.engine.calibrate()
        self.calibrated = copy.deepcopy(self.engine.orchestrator.verify_cost)  # one request's (live timings move it)
        spec_cap = verification_cap(self.calibrated)
        costs = ", ".join(f"{k}: {1000 * t:.0f}" for k, t in self.calibrated.as_dict().items())
        print(f"verification cap (one request, every draft token accepted, drafts free): {spec_cap[0]:.2f}x at a "
              f"{spec_cap[1]}-token forward; target forward ms by tokens: {costs}", file=sys.stderr)
        return spec_cap

    def ids(self, workload: str) -> list[list[int]]:
        from calid.text import encode_prompt

        return [encode_prompt(self.target.tokenizer, t) for t in self.texts[workload]]


def _measure(args, setup: _Setup, modes, workloads, sweep) -> tuple[dict, dict]:
    """Serve the app, warm every path, and time every (workload, concurrency, mode) point for every round:
    (samples by point, filter's caps by concurrency)."""
    from calid.progress import progress
    from serve_app.cluster.local import serve_app, shutdown

    cfg, engine, texts = setup.cfg, setup.engine, setup.texts
    serve_app(cfg, dashboard=False)
    samples: dict[tuple, list[dict]] = {}
    try:
        address = f"127.0.0.1:{cfg.grpc_port}"
        asyncio.run(_bursts(address, cfg.app_name, "ar", [texts[workloads[0]][:1]], 4))  # warm every path once
        for mode in modes:
            asyncio.run(_bursts(address, cfg.app_name, mode, [texts[workloads[0]][:1]], 4))
        total = args.rounds * len(workloads) * len(sweep) * len(modes)
        with progress(total, "bench modes", "point") as bar:
            for rnd in range(args.rounds):
                for w in workloads:
                    prompts, ids = texts[w], setup.ids(w)
                    for c in sweep:
                        for mode in _round_order(modes, rnd):
                            samples.setdefault((w, c, mode), []).append(
                                _point(cfg, address, engine, mode, _waves(prompts, c), _waves(ids, c),
                                       *setup.lengths[w], rnd % 2 == 1))
                            bar.update(1)
        caps = _filter_caps(engine, sweep) if engine is not None and "filter" in modes else {}
    finally:
        shutdown()
    return samples, caps


def _oracles(setup: _Setup, samples: dict, workloads, sweep) -> tuple[dict, dict, dict]:
    """What ar's own outputs say an n-gram planner could reach: the bound per workload at one request, and
    the planner's replay (and its foresight) per burst."""
    from calid.bench.ngram_bound import ngram_bound
    from calid.bench.plan_replay import replay_burst
    from calid.decoding.ngram import CopyHazard

    bounds, replays, foresights = {}, {}, {}
    for w in workloads:
        ids, known = setup.ids(w), (setup.calibrated, setup.lengths[w][0], setup.engine.orchestrator.sliced)
        bounds[w] = ngram_bound(ids, samples[(w, setup.top, "ar")][-1]["outputs"], setup.calibrated)
        print(f"n-gram bound, {w}: {bounds[w].ratio:.2f}x ar at one request (an oracle that verifies exactly the "
              f"n-gram tokens ar confirms, where they pay: {bounds[w].copied} of {bounds[w].tokens} tokens)",
              file=sys.stderr)
        for c in sweep:  # every wave of the point, one after the other, learning copy hazards as the server does
            bursts = list(zip(_waves(ids, c), _waves(samples[(w, c, "ar")][-1]["outputs"], c)))
            hazard = CopyHazard()
            replays[(w, c)] = functools.reduce(operator.add, (replay_burst(*b, *known, hazard=hazard) for b in bursts))
            foresights[(w, c)] = functools.reduce(operator.add,
                                                  (replay_burst(*b, *known, foresight=True) for b in bursts))
            print(f"planner replay, {w} c{c}: {replays[(w, c)].describe()}; with each copy's yield known "
                  f"{foresights[(w, c)].describe()}", file=sys.stderr)
    return bounds, replays, foresights


def _round_order(modes: list[str], rnd: int) -> list[str]:
    """The modes in round ``rnd``'s order: reversed every other round. A burst at c12 takes about a minute and this
    machine's speed drifts through a run (ar's burst read 58.8, 63.0 and 68.3 s in one session, an auto burst
    between each): in a fixed order the mode that runs after ar pays every round's drift."""
    return modes if rnd % 2 == 0 else modes[::-1]


def _lengths_text(lengths: dict, workloads: list[str]) -> str:
    return "; ".join(f"{w}: " + (f"to EOS, at most {n} new tokens" if to_eos else f"{n} new tokens (STRESS CASE: EOS "
                                                                                 "ignored)")
                     for w, (n, to_eos) in lengths.items() if w in workloads)


def _waves(items: list, c: int) -> list[list]:
    """``items`` in bursts of ``c``, in order (the last one may be smaller)."""
    return [items[i: i + c] for i in range(0, len(items), c)]


def _point(cfg, address, engine, mode, waves, id_waves, new, to_eos: bool, inproc_first: bool) -> dict:
    """Waves of requests of ``new`` tokens each (``to_eos``: or fewer, where EOS ends it), each wave a burst that
    ends before the next starts, served and (unless engine is None) the same waves in process, in the given
    order."""
    from serve_app.bench.serve import _model_forward_s, _server_times

    def served():
        before, overruled, models = _server_times(cfg), _overruled(cfg), _model_forward_s(cfg)
        t = time.perf_counter()
        outs = asyncio.run(_bursts(address, cfg.app_name, mode, waves, new, to_eos))
        seconds = time.perf_counter() - t
        out = [r for wave in outs for r in wave]
        step_s, steps, forward = (b - a for a, b in zip(before, _server_times(cfg)))
        model_s, target_s, forwards = (b - a for a, b in zip(models, _model_forward_s(cfg)))
        return {"served_s": seconds, "tokens": sum(len(r.token_ids) for r in out),
                "nonforward_ms": (step_s - model_s) * 1000 / forwards if forwards else float("nan"),
                "worker_ms": (forward - model_s) * 1000 / forwards if forwards else float("nan"),
                "forward_ms": target_s * 1000 / forwards if forwards else float("nan"),
                "tpot_ms": statistics.mean(_tpot_ms(r) for r in out),
                # each wave's last first token: with free decoding a wave could not end sooner
                "first_tokens_s": sum(max(float(r.stats.get("ttft_ms", 0.0)) for r in wave) for wave in outs) / 1000,
                "guard_plain": _overruled(cfg) - overruled,
                "serving_ms_per_step": (step_s - forward) * 1000 / steps if steps else float("nan"),
                "outputs": [list(r.token_ids) for r in out],
                "drafted": sum(r.stats.get("draft_tokens", 0) for r in out)}

    def inproc():
        from calid.decoding.modes import DecodeParams
        from calid.generation import GenerationRequest, SamplingParams

        params = SamplingParams(max_new_tokens=new, ignore_eos=not to_eos)
        times, model_s, target = replace(engine.times), engine.forward_s(), replace(engine.target.stats)
        t = time.perf_counter()
        out = [r for ids in id_waves
               for r in engine.generate([GenerationRequest(list(i), params, decode=DecodeParams(mode=mode))
                                         for i in ids])]
        seconds = time.perf_counter() - t
        steps, forwards = engine.times.steps - times.steps, engine.target.stats.forwards - target.forwards
        other = engine.times.step_s - times.step_s - (engine.forward_s() - model_s)
        target_s = engine.target.stats.forward_s - target.forward_s
        return {"inproc_s": seconds, "inproc_tokens": sum(len(r.output_ids) for r in out),
                "inproc_nonforward_ms": other * 1000 / forwards if forwards else float("nan"),
                "inproc_forward_ms": target_s * 1000 / forwards if forwards else float("nan"),
                "inproc_plan_ms": (engine.times.plan_s - times.plan_s) * 1000 / steps if steps else float("nan")}

    parts = [inproc, served] if inproc_first else [served, inproc]
    out = {}
    for part in parts:
        if part is inproc and engine is None:
            continue
        out.update(part())
    return out


def _tpot_ms(completion) -> float:
    """The server's time per output token after the first (its own ttft and total times of the request)."""
    s, n = completion.stats, len(completion.token_ids)
    return (float(s.get("total_ms", 0.0)) - float(s.get("ttft_ms", 0.0))) / max(1, n - 1)


def _overruled(cfg) -> int:
    """Steps the router's guard has run plain so far: plans that drafted which it overruled, and steps it did not
    let the planner price at all (StepGuard.plans)."""
    from ray import serve

    guard = serve.get_deployment_handle("router", cfg.app_name).stats.remote().result()["guard"]
    return guard.get("overruled", 0) + guard.get("unplanned", 0)


async def _bursts(address: str, app: str, mode: str, waves: list[list[str]], new: int, to_eos: bool = False):
    """Each wave's requests at once, the next wave once the last one's are all done, on one client; per wave its
    completions."""
    from calid.client import AsyncClient

    async with AsyncClient(address, app=app, timeout=1800) as c:
        return [await asyncio.gather(*[c.generate(p, max_new_tokens=new, ignore_eos=not to_eos, mode=mode)
                                       for p in prompts]) for prompts in waves]


def _filter_caps(engine, sweep: list[int]) -> dict[int, dict[str, float]]:
    """Filter's best possible ratio to ar at each batch size, and its draft's prefill time over the target's,
    timed on the engine's own runners (calid.calibration.filter_cap)."""
    from calid.calibration import filter_cap

    return {c: filter_cap(engine.target, engine.draft, c) for c in sweep}


def _rows(samples: dict, caps: dict) -> list[dict]:
    from calid.calibration import whole_request_cap

    rows = []
    for (w, c, mode), runs in samples.items():
        med = lambda key: statistics.median(r[key] for r in runs) if all(key in r for r in runs) else float("nan")
        rates = _rates(runs, "tokens", "served_s")  # served tokens/s of each round
        row = {"workload": w, "concurrency": c, "mode": mode, "served_tok_s": statistics.median(rates),
               "tpot_ms": med("tpot_ms"), "_burst_s": med("served_s"), "_first_tokens_s": med("first_tokens_s"),
               "inproc_tok_s": _median_rate(runs, "inproc_tokens", "inproc_s"),
               "serving_ms_per_step": med("serving_ms_per_step"), "nonforward_ms": med("nonforward_ms"),
               "worker_ms": med("worker_ms"), "inproc_nonforward_ms": med("inproc_nonforward_ms"),
               "inproc_plan_ms": med("inproc_plan_ms"),
               "forward_ms": med("forward_ms"), "inproc_forward_ms": med("inproc_forward_ms"),
               "draft_share": statistics.mean(r["drafted"] / max(1, r["tokens"]) for r in runs),
               "guard_plain": sum(r["guard_plain"] for r in runs) if mode != "ar" else "-",
               "filter_cap": caps[c]["cap"] if mode == "filter" and c in caps else "-",
               "filter_cap_whole": "-", "_outputs": runs[-1]["outputs"],
               "_rates": rates}
        row["served_vs_inproc"] = row["served_tok_s"] / row["inproc_tok_s"]
        rows.append(row)
    ar = {(r["workload"], r["concurrency"]): r for r in rows if r["mode"] == "ar"}
    for r in rows:
        base = ar[(r["workload"], r["concurrency"])]
        r["served_vs_ar"] = r["served_tok_s"] / base["served_tok_s"]
        # each round's ratio to ar's run of the same round, run minutes apart: how far one reading moves here
        r["rounds_vs_ar"] = " ".join(f"{a / b:.2f}" for a, b in zip(r["_rates"], base["_rates"]))
        r["inproc_vs_ar"] = r["inproc_tok_s"] / base["inproc_tok_s"]
        r["decode_vs_ar"] = base["tpot_ms"] / r["tpot_ms"] if r["tpot_ms"] > 0 else float("nan")
        # ar's burst took _burst_s, its last first token came at _first_tokens_s: with free decoding a burst
        # could not end before its prompts are in (exact at one request; under load an upper bound on prefill)
        r["prefill_cap"] = base["_burst_s"] / base["_first_tokens_s"] if base["_first_tokens_s"] > 0 else float("nan")
        same = sum(a == b for a, b in zip(r["_outputs"], base["_outputs"]))
        r["same_as_ar"] = f"{same}/{len(base['_outputs'])}"
        cap = caps.get(r["concurrency"]) if r["mode"] == "filter" else None
        if cap is not None and r["prefill_cap"] > 0:
            r["filter_cap_whole"] = whole_request_cap(cap["cap"], 1 / r["prefill_cap"], cap["prefill_ratio"])
    for r in rows:
        for key in ("_outputs", "_burst_s", "_first_tokens_s", "_rates"):
            del r[key]
    return rows


def _rates(runs: list[dict], tokens: str, seconds: str) -> list[float]:
    """Each run's tokens / seconds (runs that stop at EOS may differ in tokens; [] if a run was not timed)."""
    if not all(seconds in r for r in runs):
        return []
    return [r.get(tokens, r["tokens"]) / r[seconds] for r in runs]


def _median_rate(runs: list[dict], tokens: str, seconds: str) -> float:
    """The median over runs of tokens / seconds (nan if a run was not timed)."""
    rates = _rates(runs, tokens, seconds)
    return statistics.median(rates) if rates else float("nan")


def _whole(decoding: float, prefill_cap: float) -> float:
    """A speed-up of decoding alone, on whole requests: prefill takes 1 / prefill_cap of ar's time and stays."""
    prefill = 1 / prefill_cap
    return 1 / (prefill + (1 - prefill) / decoding)


def _verdict(rows: list[dict], modes: list[str], bounds: dict | None = None, replays: dict | None = None,
             foresights: dict | None = None) -> str:
    """The issue's targets, point by point (``bounds``: the n-gram bound per workload; ``replays`` and
    ``foresights``: the planner replay per workload and concurrency, guessing and knowing each copy's yield)."""
    lines = []
    for r in rows:
        goal = {"auto": 1.3 if r["workload"] == "grounded" else 0.98, "filter": 1.3}.get(r["mode"])
        if goal is not None:
            ok = r["served_vs_ar"] >= goal
            line = (f"{r['workload']} c{r['concurrency']} {r['mode']}: {r['served_vs_ar']:.2f}x ar served "
                    f"(target >= {goal}: {'met' if ok else 'missed'}; by round {r['rounds_vs_ar']}); "
                    f"decoding alone {r['decode_vs_ar']:.2f}x ar; "
                    f"whole requests cannot beat ar by more than {r['prefill_cap']:.2f}x here (prefill)")
            if r["mode"] == "filter" and isinstance(r["filter_cap"], float):
                line += f"; cap on this machine {r['filter_cap']:.2f}x (decoding alone)"
                if isinstance(r["filter_cap_whole"], float):
                    line += f", {r['filter_cap_whole']:.2f}x on whole requests (the draft prefills every prompt too)"
            if r["mode"] == "auto" and r["workload"] in (bounds or {}):
                bound = bounds[r["workload"]].ratio
                line += f"; n-gram bound on this machine {bound:.2f}x at c1 (decoding alone)"
                if r["concurrency"] == 1:
                    line += f", {_whole(bound, r['prefill_cap']):.2f}x on whole requests"
            if r["mode"] == "auto" and (replay := (replays or {}).get((r["workload"], r["concurrency"]))):
                line += (
                    f"; the planner's copies replayed on ar's outputs {replay.ratio:.2f}x (decoding alone, no noise)"
                )
            if r["mode"] == "auto" and (known := (foresights or {}).get((r["workload"], r["concurrency"]))):
                line += (f"; with each copy's yield known {known.ratio:.2f}x, "
                         f"{_whole(known.ratio, r['prefill_cap']):.2f}x on whole requests (the most n-gram copies "
                         "reach at this load)")
            lines.append(line)
        if r["served_vs_inproc"] == r["served_vs_inproc"]:  # not NaN
            lines.append(
                f"{r['workload']} c{r['concurrency']} {r['mode']}: served/in-process "
                f"{r['served_vs_inproc']:.2f} (target >= {SERVED_VS_INPROC}: "
                f"{'met' if r['served_vs_inproc'] >= SERVED_VS_INPROC else 'missed'})"
            )
    return "\n".join(lines)
