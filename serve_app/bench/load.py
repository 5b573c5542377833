"""``calid bench load``: every mode under the same loads, through gRPC, side by side in one run.

Loads, in this order (every mode runs each load before the next load starts, so that drift on a shared
machine hits all modes alike):
  c1, c4, c16   a concurrency sweep: C clients, each sending its next request when the last one ends, with
                prompts of --workload (default mix: code to write, text to edit, open chat, in turn) through the
                chat template, each answer to its EOS as users' requests end (--ignore-eos: the labelled
                stress case, every answer --max-new-tokens long);
  light, capacity, overload
                a replay of the Azure LLM inference trace 2023 (its first requests: arrival gaps and lengths)
                scaled to 0.25x, 1x and 2x the request rate ar sustains at the highest concurrency (measured
                in this run), each for about --trace-seconds (so a replay holds rate x seconds requests, at
                least 4); prompts are windows of real text (HumanEval) cut to the trace's prompt lengths, each
                answer as long as the trace's (EOS ignored).
Prompt and output lengths are capped (--max-prompt-tokens, --max-new-tokens) to keep the default run near
20 minutes on a 2-core CPU. Scores per mode and load: throughput, goodput (tokens of requests that met the
SLO), TTFT and TPOT p50/p99 (calid.placement.traffic), goodput as a ratio to ar, the n-gram-copyable share of
the sweep's outputs; a PNG plots goodput and p99 TPOT against load. The SLO defaults to --slo-scale times ar's
TTFT and TPOT p50 at the lowest concurrency.
"""
from __future__ import annotations

import asyncio
import statistics
from contextlib import contextmanager
import sys
import time
from pathlib import Path

from calid.bench.data import WORKLOADS
from calid.placement.traffic import DEFAULT_TRACE

COLUMNS = ["load", "mode", "requests", "errors", "tokens", "tok_s", "tok_s_vs_ar", "goodput_tok_s", "goodput_vs_ar",
           "slo_met",
           "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "draft_share", "ngram_share"]
RATES = {"light": 0.25, "capacity": 1.0, "overload": 2.0}  # trace replays, in multiples of ar's capacity


def add_parser(sub) -> None:
    p = sub.add_parser("load", help="goodput, TTFT and TPOT per mode under load: concurrency sweep and trace replay")
    p.add_argument("--small", action="store_true", help="SmolLM2-135M with self:16 instead of the Qwen pair")
    p.add_argument("--modes", default="ar,speculative,auto", help="comma-separated modes (ar always runs first)")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Azure LLM trace CSV (TIMESTAMP,ContextTokens,"
                   "GeneratedTokens)")
    p.add_argument("--trace-seconds", type=float, default=45.0, help="length of each replay (default 45 s): "
                   "rate x seconds requests, at least 4")
    p.add_argument("--trace-requests", type=int, default=64, help="most requests one replay holds (default 64)")
    p.add_argument("--rates", default="light,capacity,overload", help=f"trace replays among {', '.join(RATES)}")
    p.add_argument("--max-new-tokens", type=int, default=64, help="at most this many tokens an answer (default 64)")
    p.add_argument("--workload", default="mix", choices=WORKLOADS, help="the sweep's prompts (default mix: code to "
                   "write, text to edit or summarize, open chat, in turn; calid.bench.data.workload_prompts)")
    p.add_argument("--ignore-eos", action="store_true", help="stress case: the sweep's answers run past EOS to "
                   "--max-new-tokens")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--slo-scale", type=float, default=5.0, help="SLO = this x ar's TTFT and TPOT p50 at the "
                   "lowest concurrency (default 5)")
    p.add_argument("--slo-ttft-s", type=float, default=None)
    p.add_argument("--slo-tpot-s", type=float, default=None)
    p.add_argument("--port", type=int, default=50064)
    p.add_argument("--out", default="bench_results")
    p.set_defaults(func=run)


def _options(args):
    from calid.bench.report import parse_numbers
    from calid.decoding.modes import MODES
    from calid.errors import CalidError

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in MODES for m in modes):
        raise CalidError(f"--modes must be a comma-separated subset of {', '.join(MODES)}, got {args.modes!r}")
    modes = ["ar"] + [m for m in modes if m != "ar"]
    sweep = parse_numbers(args.concurrency, int)
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    if not sweep or min(sweep) < 1 or any(r not in RATES for r in rates):
        raise CalidError(f"--concurrency takes counts >= 1 and --rates a subset of {', '.join(RATES)}")
    if min(args.trace_requests, args.max_new_tokens, args.max_prompt_tokens) < 1 or min(args.slo_scale,
                                                                                        args.trace_seconds) <= 0:
        raise CalidError("--trace-requests, --trace-seconds, --max-new-tokens, --max-prompt-tokens and --slo-scale "
                         "must be > 0")
    if rates and not Path(args.trace).is_file():
        raise CalidError(f"no trace at {args.trace}: pass --trace PATH, or --rates '' to skip the replays")
    return modes, sorted(set(sweep)), rates


def run(args) -> int:
    from calid.backends import cpu_summary, model_facts
    from calid.placement import traffic as load
    from calid.bench.data import humaneval_prompts, workload_prompts
    from calid.bench.plot import load_curves
    from calid.bench.report import write_report
    from calid.models.loader import load_tokenizer
    from calid.progress import progress
    from serve_app.cluster.config import AppConfig
    from serve_app.cluster.local import serve_app, shutdown

    modes, sweep, rates = _options(args)
    base = AppConfig.small if args.small else AppConfig
    # every mode replays the same prompts: no prompt cache, or a mode after the first would skip its prefills
    cfg = base(grpc_port=args.port, http_port=0, max_active=max(16, max(sweep)), queue_capacity=256, prompt_cache=False)
    _, folder = model_facts(cfg.target, cfg.target_backend, cfg.target_on, cfg.sharded, show_progress=False)
    tokenizer = load_tokenizer(folder)
    corpus = tokenizer("\n\n".join(humaneval_prompts()), add_special_tokens=False)["input_ids"]
    trace = []
    if rates:
        trace = load.capped(load.read_trace(Path(args.trace), args.trace_requests), args.max_prompt_tokens,
                            args.max_new_tokens)
    trace_prompts = [tokenizer.decode(ids) for ids in load.cut_prompts(corpus, [r.prompt_tokens for r in trace])]
    sweep_prompts = workload_prompts(args.workload, 64)
    print(
        f"bench load: target {cfg.target}, draft {cfg.draft}; modes {modes}; concurrency {sweep}; trace "
        f"replays of ~{args.trace_seconds:g} s at {rates}; <= {args.max_prompt_tokens} prompt / "
        f"{args.max_new_tokens} new tokens; sweep: workload {args.workload}, "
        f"{'EOS ignored (stress case)' if args.ignore_eos else 'to EOS'}; greedy; {cpu_summary()}",
        file=sys.stderr,
    )
    serve_app(cfg, dashboard=False)
    runs: dict[tuple[str, str], list] = {}
    shares: dict[tuple[str, str], float] = {}  # the share of the router's step time spent in draft calls
    try:
        address = f"127.0.0.1:{cfg.grpc_port}"
        asyncio.run(_warm(address, cfg.app_name, modes, sweep_prompts[0]))
        with progress(len(modes) * (len(sweep) + len(rates)), "bench load", "run") as bar:
            for c in sweep:
                for mode in modes:
                    n = max(c, 4)
                    with _draft_share(cfg, shares, (f"c{c}", mode)):
                        runs[(f"c{c}", mode)] = asyncio.run(_closed_loop(address, cfg.app_name, mode, c, n,
                                                                          sweep_prompts, args.max_new_tokens,
                                                                          args.ignore_eos))
                    bar.update(1)
            ar_top = load.score(runs[(f"c{sweep[-1]}", "ar")], load.Slo(float("inf"), float("inf")))
            capacity_rps = ar_top["tok_s"] / statistics.mean(r.output_tokens for r in trace) if trace else 0.0
            for name in rates:
                rate = RATES[name] * capacity_rps
                n = min(len(trace), max(4, round(rate * args.trace_seconds)))
                shaped = load.at_rate(trace[:n], rate)
                for mode in modes:
                    with _draft_share(cfg, shares, (name, mode)):
                        runs[(name, mode)] = asyncio.run(_replay(address, cfg.app_name, mode, shaped,
                                                                 trace_prompts[:n]))
                    bar.update(1)
    finally:
        shutdown()
    slo = _slo(args, runs[(f"c{sweep[0]}", "ar")])
    rows = _rows(runs, slo, tokenizer)
    for r in rows:
        r["draft_share"] = shares.get((r["load"], r["mode"]), float("nan"))
    loads = [f"c{c}" for c in sweep] + rates
    meta = {"target": cfg.target, "draft": cfg.draft, "modes": ",".join(modes), "cpu": cpu_summary(),
            "slo_ttft_s": round(slo.ttft_s, 3), "slo_tpot_s": round(slo.tpot_s, 3),
            "capacity_rps": round(capacity_rps, 3) if rates else "-", "trace": Path(args.trace).name if rates else "-"}
    notes = _notes(args)
    name = f"load-{'small' if args.small else 'qwen'}"
    js, md = write_report(Path(args.out), name, "goodput under load, per mode, through gRPC", meta, rows, COLUMNS,
                          notes)
    png = load_curves(rows, loads, Path(args.out) / f"{name}.png")
    print(md.read_text())
    print(_verdict(rows, loads), file=sys.stderr)
    print(f"wrote {js}, {md} and {png}", file=sys.stderr)
    return 0


def _notes(args) -> list[str]:
    return [
        "goodput = output tokens/s of the requests that met the SLO (TTFT and TPOT); goodput_vs_ar: ratio to ar "
        "at the same load",
        "c<N>: N clients in a closed loop; light / capacity / overload: the trace replayed at 0.25x / 1x / 2x "
        f"the request rate ar sustains at the highest concurrency, each for ~{args.trace_seconds:g} s (rate x "
        "seconds requests, at least 4)",
        f"prompts: HumanEval text cut to the trace's prompt lengths (capped at {args.max_prompt_tokens} tokens); "
        f"outputs capped at {args.max_new_tokens} tokens; the sweep's answers end at EOS"
        f"{' (not this run: --ignore-eos, the stress case)' if args.ignore_eos else ''}, the replays' at the "
        "trace's lengths",
        "ngram_share: of the sweep's output tokens, those an n-gram proposal from the request's own text (prompt "
        "through the chat template, and output so far) would have predicted: what copying drafts can find",
        "draft_share = the router's time waiting for draft calls / its step time: the most that drafting the next "
        "step while the target verifies this one (LLMCad's draft-while-verify) could take off a step",
    ]


@contextmanager
def _draft_share(cfg, shares: dict, key) -> None:
    from ray import serve

    router = serve.get_deployment_handle("router", cfg.app_name)
    before = router.stats.remote().result()
    yield
    after = router.stats.remote().result()
    step = after["step_s"] - before["step_s"]
    draft = after["call_s"].get("draft", 0.0) - before["call_s"].get("draft", 0.0)
    shares[key] = draft / step if step > 0 else float("nan")


def _slo(args, ar_low: list):
    from calid.placement import traffic as load

    base = load.score(ar_low, load.Slo(float("inf"), float("inf")))
    return load.Slo(args.slo_ttft_s or args.slo_scale * base["ttft_ms_p50"] / 1000,
                    args.slo_tpot_s or args.slo_scale * base["tpot_ms_p50"] / 1000)


def _rows(runs: dict, slo, tokenizer=None) -> list[dict]:
    from calid.bench.ngram_bound import ngram_share
    from calid.placement import traffic as load

    rows = []
    for (where, mode), outcomes in runs.items():
        rows.append({"load": where, "mode": mode, **load.score(outcomes, slo),
                     "ngram_share": ngram_share(tokenizer, outcomes) if where.startswith("c") else "-"})
    ar = {r["load"]: r for r in rows if r["mode"] == "ar"}
    for r in rows:
        base = ar[r["load"]]
        r["tok_s_vs_ar"] = r["tok_s"] / base["tok_s"] if base["tok_s"] > 0 else float("nan")
        r["goodput_vs_ar"] = r["goodput_tok_s"] / base["goodput_tok_s"] if base["goodput_tok_s"] > 0 else float("nan")
    return rows


def _verdict(rows: list[dict], loads: list[str]) -> str:
    """The issue's targets for auto, point by point: on goodput where ar has any (some request within the SLO),
    else on throughput (an overloaded point, where no mode meets the SLO)."""
    by = {(r["load"], r["mode"]): r for r in rows}
    if not any(m == "auto" for _, m in by):
        return "no auto runs: nothing to check"
    lines = []
    for where in loads:
        key = "goodput_tok_s" if by[(where, "ar")]["goodput_tok_s"] > 0 else "tok_s"
        auto = by[(where, "auto")][key]
        fixed = {m: r[key] for (w, m), r in by.items() if w == where and m != "auto"}
        best_mode = max(fixed, key=fixed.get)
        ar, best = fixed["ar"], fixed[best_mode]
        vs_ar, vs_best = (auto / ar if ar else float("nan")), (auto / best if best else float("nan"))
        goal = 1.5 if where == "c1" else 1.0
        lines.append(f"{where} ({'goodput' if key == 'goodput_tok_s' else 'throughput: no request within the SLO'}): "
                     f"auto {vs_ar:.2f}x ar (target >= {goal}: {'met' if vs_ar >= goal else 'missed'}), "
                     f"{vs_best:.2f}x the best fixed mode {best_mode} (target >= 0.95: "
                     f"{'met' if vs_best >= 0.95 else 'missed'})")
    return "\n".join(lines)


async def _warm(address: str, app: str, modes: list[str], prompt: str) -> None:
    """One short request per mode, so that no run pays for a first call (calibration, caches)."""
    from calid.client import AsyncClient

    async with AsyncClient(address, app=app, timeout=900) as c:
        for mode in modes:
            await c.generate(prompt, max_new_tokens=4, ignore_eos=True, mode=mode)


async def _one(c, prompt: str, mode: str, max_new: int, ignore_eos: bool = True, **kw):
    """One streamed request as the client sees it (``kw``: more request fields, e.g. model, raw_prompt); a chat
    request (no raw_prompt) keeps its prompt and answer for the n-gram share."""
    from calid.placement.traffic import Outcome

    sent = time.perf_counter()
    first = last = None
    tokens, pieces = 0, []
    try:
        async for chunk in c.stream(prompt, max_new_tokens=max_new, ignore_eos=ignore_eos, mode=mode, **kw):
            if chunk.token_ids:
                last = time.perf_counter()
                first = first or last
                tokens += len(chunk.token_ids)
                pieces.append(chunk.text)
    except Exception as e:  # noqa: BLE001 - counted as an error in the run's row
        return Outcome(sent, first, last, tokens, error=f"{type(e).__name__}: {e}")
    chat = not kw.get("raw_prompt")
    return Outcome(sent, first, last, tokens, prompt=prompt if chat else "", text="".join(pieces) if chat else "")


async def _closed_loop(address: str, app: str, mode: str, clients: int, n: int, prompts: list[str],
                       max_new: int, ignore_eos: bool = False) -> list:
    from calid.client import AsyncClient

    todo = list(range(n))
    out = []

    async def client(c):
        while todo:
            i = todo.pop()
            out.append(await _one(c, prompts[i % len(prompts)], mode, max_new, ignore_eos))

    async with AsyncClient(address, app=app, timeout=1800) as c:
        await asyncio.gather(*(client(c) for _ in range(clients)))
    return out


async def _replay(address: str, app: str, mode: str, trace: list, prompts: list[str]) -> list:
    from calid.client import AsyncClient

    async with AsyncClient(address, app=app, timeout=1800) as c:
        start = time.perf_counter()

        async def at(r, prompt):
            await asyncio.sleep(max(0.0, start + r.at_s - time.perf_counter()))
            return await _one(c, prompt, mode, r.output_tokens)

        return list(await asyncio.gather(*(at(r, p) for r, p in zip(trace, prompts))))
