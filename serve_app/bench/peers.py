"""``calid bench peers``: calid against the servers a user would run instead, through one OpenAI client.

One load client (the openai SDK's async client, streaming chat completions, greedy, the same HumanEval
prompts, each answer to its EOS as users' requests end; ``--ignore-eos``: the labelled stress case) runs a
closed-loop concurrency sweep against, one after the other on the same machine and GGUF:
  calid               ``calid serve``'s OpenAI HTTP API, in each of --modes (ar, auto, filter);
  llama-cpp-python    its own OpenAI server (``python -m llama_cpp.server``) over the same llama-cpp-python
                      build calid uses (it needs the server's web packages: ``pip install 'calid[bench]'``);
  llama-server        llama.cpp's C++ server with continuous batching, one slot per client (``-np`` = the
                      point's concurrency, started afresh per point), when --llama-server names its binary
                      (scripts/build_llama_server.sh builds it from the llama-cpp-python sources), in each of
                      --llama-configs: plain, or with llama.cpp's own speculation (the draft calid drafts with,
                      n-gram lookups, both chained; serve_app.bench.peer_servers.SPEC_CONFIGS).
Then, per server and mode, an open-loop replay of the Azure LLM inference trace (conversation services:
its arrival gaps, prompt and output lengths; prompts cut from HumanEval's text to the trace's lengths, sent
as raw completions) at --trace-rate times the request rate calid ar sustained at the sweep's top
concurrency. Per server, mode and load: output tokens/s, TTFT p50/p99, TPOT p50, the share of requests
within an SLO (--slo-scale x calid ar's TTFT and TPOT p50 at the lowest concurrency), and each one's ratio to
calid ar at the same load; the share of output tokens that came from drafts (calid's per-request stats,
llama-server's ``llamacpp:spec_decode_*`` counters, with its acceptance rate); a PNG of throughput vs
concurrency; the CPU flags and the bandwidth limit. With
--rounds N the whole sweep runs N times, every server started afresh each round and the servers in reverse order
every other round (this machine's speed drifts over minutes): tokens/s is the median of the rounds, its ratio
the median of each round's ratio to calid ar in the same round, and the latencies pool every round's requests.
Tokens are counted from the usage a server reports at the end of a stream (stream_options.include_usage), else
one per streamed chunk.
A server that cannot start is reported with the reason, and the others still run.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import socket
import statistics
import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from calid.placement.traffic import DEFAULT_TRACE
from calid.bench.data import WORKLOADS
from calid.runtime.prefill_weights import CHOICES as PREFILL_WEIGHTS
from serve_app.bench.peer_servers import (DEFAULT_SPEC, PEERS, PeerServer, PeerUnavailable,
                                         check_spec_configs)
from serve_app.cluster.config import add_topology_arg

COLUMNS = ["server", "mode", "load", "requests", "errors", "tokens", "tok_s", "tok_s_vs_calid_ar",
           "rounds_vs_calid_ar", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "slo_met",
           "draft_share", "spec_acceptance", "ngram_share", "limit_tok_s"]
PROMPTS = 240  # prompts a run draws from, in turn
# fewest requests a point sends: HumanEval answers of Qwen 1.5B differ by 1.4x in TPOT under one server, so a point
# of 4 decided by which 4 prompts it drew (auto / llama-server ngram-simple at c1, EPYC 2 cores: 0.96 and 0.97 in two
# rounds of the same 4 prompts; 1.01 and 1.04 in two rounds of 16)
MIN_REQUESTS = 16
CONNECT_RETRIES = 2  # the openai SDK's default max_retries: a request whose connection failed is sent again


def add_parser(sub) -> None:
    p = sub.add_parser("peers", help="calid vs llama-cpp-python's server vs llama-server, one OpenAI load client")
    p.add_argument("--small", action="store_true", help="SmolLM2-135M (self:16 draft) instead of the Qwen pair")
    p.add_argument("--modes", default="ar,auto,filter", help="calid modes to run (comma-separated)")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated among {', '.join(PEERS)}")
    p.add_argument("--concurrency", default="1,4,8,16", help="closed-loop client counts")
    p.add_argument("--requests", type=int, default=0,
                   help=f"requests per point (default: 2 x concurrency, >= {MIN_REQUESTS})")
    p.add_argument("--rounds", type=int, default=1, help="repeats of the sweep, servers in reverse order every other "
                   "round (medians reported; the trace replay runs in the first round only)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="at most this many tokens an answer (default 96)")
    p.add_argument("--ignore-eos", action="store_true", help="stress case: the sweep's answers run past EOS to "
                   "--max-new-tokens (the trace replay always runs to the trace's output lengths)")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads of every server (default: all cores)")
    p.add_argument("--peer-hugepages", action="store_true", help="start the peers with calid's malloc huge-page "
                   "tunable too (calid.hugepages; default: as their users start them, without it)")
    p.add_argument("--llama-server", default=shutil.which("llama-server"),
                   help="llama-server binary (default: on PATH)")
    p.add_argument("--llama-configs", default=DEFAULT_SPEC, help="llama-server configurations to run, each a row "
                   f"(default {DEFAULT_SPEC}; also draft-n<K>: the draft with --spec-draft-n-max K)")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Azure LLM trace CSV to replay ('' : no replay)")
    p.add_argument("--trace-rate", type=float, default=0.5, help="replay rate, in multiples of the request rate "
                   "calid ar sustains at the sweep's top concurrency (default 0.5)")
    p.add_argument("--trace-requests", type=int, default=24, help="requests in the replay (default 24)")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="trace prompts are cut to at most this")
    p.add_argument("--slo-scale", type=float, default=5.0, help="SLO: this x calid ar's TTFT and TPOT p50 at the "
                   "lowest concurrency")
    add_topology_arg(p)
    p.add_argument("--workload", default="mix", choices=WORKLOADS, help="the prompts (default mix: code to write, "
                   "text to edit or summarize, open chat, in turn; calid.bench.data.workload_prompts)")
    p.add_argument("--plain-run-ms", type=float, default=None, help="override calid's plain_run_ms (0: one target step "
                   "per call)")
    p.add_argument("--prefill-weights", default=None, choices=PREFILL_WEIGHTS, help="override calid's "
                   "prefill_weights (calid.runtime.prefill_weights; default: the app config's, auto)")
    p.add_argument("--port", type=int, default=8093, help="HTTP port each server takes in turn")
    p.add_argument("--out", default="bench_results")
    p.set_defaults(func=run)


def run(args) -> int:
    from calid.backends import cpu_summary, gguf_file, open_model
    from calid.bench.data import workload_prompts
    from calid.bench.hardware import decode_limit_tok_s, memory_bandwidth_gbs
    from calid.bench.report import write_report
    from serve_app.cluster.config import AppConfig, with_plain_run_ms

    modes, peers, sweep, configs = _parse(args)
    threads = args.threads or os.cpu_count() or 1
    cfg = (AppConfig.small if args.small else AppConfig)(grpc_port=_free_port(), http_port=args.port,
                                                         max_active=max(16, max(sweep)), worker_threads=threads,
                                                         topology=args.topology,
                                                         **({"prefill_weights": args.prefill_weights}
                                                            if args.prefill_weights else {}))
    cfg = with_plain_run_ms(cfg, args.plain_run_ms)
    gguf = str(gguf_file(cfg.target, False))
    target = open_model(cfg.target, log=lambda line: None, show_progress=False)
    weight_bytes = target.decode_read_bytes
    bandwidth = memory_bandwidth_gbs()
    limit = decode_limit_tok_s(bandwidth, weight_bytes)
    # every point takes the next ones: a prompt never repeats within a server's run
    prompts = workload_prompts(args.workload, PROMPTS)
    print(f"bench peers: {cfg.target} ({Path(gguf).name}), {threads} threads; calid modes {modes}; peers {peers}; "
          f"concurrency {sweep}; {args.rounds} round(s); workload {args.workload}; at most {args.max_new_tokens} new "
          f"tokens, greedy; calid topology {cfg.topology}, prefill_weights {cfg.prefill_weights}; {cpu_summary()}; "
          f"peers "
          f"{'with' if args.peer_hugepages else 'without (as their users start them)'} calid's huge-page tunable; "
          f"decode limit {limit:.1f} tok/s at batch 1 ({bandwidth:.1f} GB/s / {weight_bytes / 1e9:.2f} GB)",
          file=sys.stderr)
    runs, skipped = [], {}
    url = f"http://127.0.0.1:{args.port}/v1"
    servers = _Servers(cfg, gguf, threads, args.port, args.llama_server,
                       _draft_gguf(cfg, threads) if "llama-server" in peers else None, args.peer_hugepages)
    replays = _Replays(args, cfg.target, url)
    per_round = sum(_requests(args, c) for c in sweep)
    for rnd in range(args.rounds):
        # a fresh server per mode and round: the modes take the same prompts, and a mode after the first would
        # answer from what the one before left in the prompt cache (auto: TTFT 69 ms, not 1.2 s)
        order = [s for s in [("calid", m) for m in modes] + [(p, "ar") for p in peers if p != "llama-server"] +
                 [("llama-server", c) for c in configs if "llama-server" in peers] if s not in skipped]
        # every round takes the next prompts (no server answers from a prompt cache); one round's servers the same
        start = 1 + rnd * per_round % (len(prompts) - 1)
        batch = prompts[:1] + prompts[start:] + prompts[1:start]
        points = _points(sweep, batch, args)
        for server, mode in order if rnd % 2 == 0 else order[::-1]:
            try:
                replay = partial(replays, server, mode) if rnd == 0 and args.trace else None
                runs += [(*r[:4], rnd, r[4]) for r in _sweep(url, servers, server, mode, batch[0], points, args,
                                                             replay)]
            except PeerUnavailable as e:
                skipped[server, mode] = str(e)
                print(f"bench peers: {server} {mode} not run: {e}", file=sys.stderr)
    replay = replays.plan
    rows, slo = _rows(runs, args.slo_scale, limit, target.tokenizer)
    meta = {"model": cfg.target, "gguf": Path(gguf).name, "workload": args.workload, "topology": cfg.topology,
            "threads": threads, "cpu": cpu_summary(), "peer_hugepages": args.peer_hugepages,
            "bandwidth_GBps": round(bandwidth, 1), "new_tokens": args.max_new_tokens,
            "rounds": args.rounds, "slo": f"TTFT <= {slo.ttft_s * 1000:.0f} ms, TPOT <= {slo.tpot_s * 1000:.0f} ms",
            **({"replay": f"{replay.name}: {len(replay.trace)} requests at {replay.rate:.3f}/s ({args.trace_rate:g} x "
                          f"calid ar's {replay.capacity:.3f}/s), {replay.mean_prompt:.0f} prompt / "
                          f"{replay.mean_output:.0f} output tokens on average"} if replay else {})}
    notes = _notes(args.slo_scale, sweep[0]) + [f"not run: {' '.join(key)}: {why}" for key, why in skipped.items()]
    name = f"peers-{'small' if args.small else 'qwen'}"
    js, md = write_report(Path(args.out), name, "calid vs the servers a user would pick instead (one OpenAI client)",
                          meta, rows, COLUMNS, notes)
    png = _plot(rows, Path(args.out) / f"{name}.png")
    print(md.read_text())
    print(f"wrote {js}, {md} and {png}", file=sys.stderr)
    return 0


def _parse(args) -> tuple[list[str], list[str], list[int], list[str]]:
    """(calid modes, ar first; peers; concurrencies; llama-server configurations), or a one-line error."""
    from calid.bench.report import parse_numbers
    from calid.decoding.modes import MODES
    from calid.errors import CalidError

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    sweep = sorted(set(parse_numbers(args.concurrency, int)))
    if any(m not in MODES for m in modes) or any(p not in PEERS for p in peers) or not sweep or min(sweep) < 1:
        raise CalidError(f"--modes among {', '.join(MODES)}, --peers among {', '.join(PEERS)}, --concurrency >= 1")
    if args.rounds < 1:
        raise CalidError("--rounds takes a count >= 1")
    configs = check_spec_configs([c.strip() for c in args.llama_configs.split(",") if c.strip()])
    return ["ar"] + [m for m in modes if m != "ar"], peers, sweep, configs


def _notes(slo_scale: float, first_concurrency: int) -> list[str]:
    return ["tok_s: output tokens of all requests / wall time of the point (first send to last token), median of "
            "the rounds; c<N>: N clients in a closed loop (each sends its next request when the last one ends); "
            "trace: the Azure trace replayed open-loop (each request sent at its arrival time; first round only); "
            "tok_s_vs_calid_ar: median of rounds_vs_calid_ar, each round's ratio to calid ar at the same load in "
            "that round (servers in reverse order every other round)",
            "TTFT: send to first streamed token; TPOT: (last - first token) / (tokens - 1), per request; slo_met: "
            f"share of requests with TTFT and TPOT within the SLO ({slo_scale:g} x calid ar's p50 at "
            f"c{first_concurrency})",
            "ngram_share: of the output tokens of the chat requests, those an n-gram proposal from the request's own "
            "text (prompt through the chat template, and output so far) would have predicted: what copying drafts "
            "(auto's n-gram chains, Lookahead, llama-server's ngram speculation) can find, before any cost",
            "draft_share: output tokens that came from drafts (calid: each answer's stats; llama-server: the accepted "
            "draft tokens of its llamacpp:spec_decode_* counters); spec_acceptance: llama-server's accepted / drafted "
            "tokens; llama-server rows: mode = its speculation configuration, started afresh per point with -np = c",
            "limit_tok_s: bandwidth / weight bytes per decode step x concurrency (a batch reads the weights once)"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _calid:
    def __init__(self, cfg):
        self.cfg = cfg

    def __enter__(self):
        from serve_app.cluster.local import serve_app

        serve_app(self.cfg, dashboard=False)
        return self

    def counters(self) -> dict:
        return {}  # calid's draft share comes with each answer (its calid stats)

    def __exit__(self, *exc):
        from serve_app.cluster.local import shutdown

        shutdown()


@dataclass(frozen=True)
class _Servers:
    """Starts any server of the bench on 127.0.0.1:port."""

    cfg: object  # calid's AppConfig
    gguf: str  # the target's GGUF, which every peer serves
    threads: int
    port: int
    llama_server: str | None  # its binary
    draft: Path | None  # the draft's GGUF as calid drafts with it (llama-server's -md), None for a self-draft
    hugepages: bool = False  # peers start with calid's malloc huge-page tunable (calid.hugepages)

    def start(self, server: str, mode: str, slots: int):
        if server == "calid":
            return _calid(self.cfg)
        return PeerServer(server, self.gguf, self.threads, self.port, slots, self.llama_server, self.cfg.target,
                          spec=mode if server == "llama-server" else "plain", draft=self.draft,
                          hugepages=self.hugepages)


def _draft_gguf(cfg, threads: int) -> Path | None:
    """The GGUF calid's draft loads (after its draft_weights choice), for llama-server's -md; None for a
    self-draft."""
    from calid.backends import cpu_summary, gguf_file
    from calid.models.draft_weights import draft_weights

    gguf = gguf_file(cfg.draft, False) if cfg.draft and not cfg.draft.startswith("self") else None
    return draft_weights(gguf, cfg.draft_weights, threads, cpu_summary()) if gguf else None


def _requests(args, c: int) -> int:
    """How many requests a point at concurrency c sends: --requests, else twice c and at least MIN_REQUESTS."""
    return args.requests or max(MIN_REQUESTS, 2 * c)


def _points(sweep: list[int], prompts: list[str], args) -> list[tuple[int, list[str]]]:
    """(concurrency, its prompts) per point: fresh prompts per point, the same ones for every server, so that no
    server answers from a prompt cache; prompts[0] is kept for warming a server up."""
    points, at = [], 1
    for c in sweep:
        n = _requests(args, c)
        points.append((c, [prompts[(at + i) % len(prompts)] for i in range(n)]))
        at += n
    return points


def _sweep(url: str, servers: _Servers, server: str, mode: str, warm: str, points: list, args, after) -> list:
    """(server, mode, load, outcomes, speculation counters) per point of the closed-loop sweep, then what
    ``after(those)`` adds (the trace replay). llama-server starts afresh per point with one slot per client
    (-np = the concurrency, as it is meant to run); calid and llama-cpp-python serve the whole sweep. Every
    server started is first sent ``warm`` (first-call costs), a prompt no point sends."""
    model, runs, top = servers.cfg.target, [], max(c for c, _ in points)

    @contextmanager
    def started(slots: int):
        with servers.start(server, mode, slots) as running:
            asyncio.run(_closed_loop(url, model, mode, server, 1, [warm], 8, True))
            yield running

    def then() -> list:
        return [r for r in [after(runs)] if r] if after else []

    if server == "llama-server":
        for c, prompts in points:
            with started(c) as running:
                runs.append(_point(url, running, model, server, mode, c, prompts, args))
        if after is None:
            return runs
        with started(top):
            return runs + then()
    with started(top) as running:
        runs += [_point(url, running, model, server, mode, c, prompts, args) for c, prompts in points]
        return runs + then()


def _point(url: str, running, model: str, server: str, mode: str, c: int, prompts: list[str], args) -> tuple:
    """One point: ``prompts`` by c clients in a closed loop, and the server's speculation counters over it."""
    before = running.counters()
    outs = asyncio.run(_closed_loop(url, model, mode, server, c, prompts, args.max_new_tokens, args.ignore_eos))
    counters = {k: v - before[k] for k, v in running.counters().items()}
    _say(server, mode, f"c{c}", outs)
    return server, mode, f"c{c}", outs, counters


class _Replays:
    """The trace replay (first round only): planned from calid ar's sweep (its rate follows what ar sustained;
    calid ar runs first), then run on every server."""

    def __init__(self, args, model: str, url: str):
        self.args, self.model, self.url, self.plan = args, model, url, None

    def __call__(self, server: str, mode: str, runs: list) -> tuple | None:
        if (server, mode) == ("calid", "ar"):
            self.plan = _replay_plan(self.args, self.model, runs[-1][3])
        return (*_replay(self.url, self.model, server, mode, self.plan), {}) if self.plan else None


@dataclass(frozen=True)
class ReplayPlan:
    name: str  # the trace file's name
    trace: list  # calid.placement.traffic.TraceRequest, at the replay's rate
    prompts: list[str]
    rate: float  # requests per second
    capacity: float  # requests per second calid ar sustained at the sweep's top concurrency

    @property
    def mean_prompt(self) -> float:
        return statistics.mean(r.prompt_tokens for r in self.trace)

    @property
    def mean_output(self) -> float:
        return statistics.mean(r.output_tokens for r in self.trace)


def _replay_plan(args, model: str, ar_top: list) -> ReplayPlan:
    """The trace's first requests (lengths capped), prompts cut from HumanEval's text to their lengths, at
    --trace-rate x the rate calid ar sustained at the top of the sweep (its tokens/s / the mean output)."""
    from calid.backends import model_facts
    from calid.placement import traffic as load
    from calid.bench.data import humaneval_prompts
    from calid.errors import CalidError
    from calid.models.loader import load_tokenizer

    if not Path(args.trace).is_file():
        raise CalidError(f"no trace at {args.trace}: pass --trace PATH, or --trace '' to skip the replay")
    if args.trace_rate <= 0 or args.trace_requests < 2 or args.max_prompt_tokens < 1:
        raise CalidError("--trace-rate must be > 0, --trace-requests >= 2, --max-prompt-tokens >= 1")
    trace = load.capped(load.read_trace(Path(args.trace), args.trace_requests), args.max_prompt_tokens,
                        args.max_new_tokens)
    tokenizer = load_tokenizer(model_facts(model, show_progress=False)[1])
    corpus = tokenizer("\n\n".join(humaneval_prompts()), add_special_tokens=False)["input_ids"]
    prompts = [tokenizer.decode(ids) for ids in load.cut_prompts(corpus, [r.prompt_tokens for r in trace])]
    capacity = load.score(ar_top, load.Slo(float("inf"), float("inf")))["tok_s"] / \
        statistics.mean(r.output_tokens for r in trace)
    rate = args.trace_rate * capacity
    return ReplayPlan(Path(args.trace).name, load.at_rate(trace, rate), prompts, rate, capacity)


def _replay(url: str, model: str, server: str, mode: str, plan: ReplayPlan) -> tuple:
    """(server, mode, "trace", outcomes): each request sent at its arrival time, as a raw completion."""
    async def go():
        from openai import AsyncOpenAI

        async with AsyncOpenAI(base_url=url, api_key="none", timeout=1800, max_retries=0) as client:
            start = time.perf_counter()

            async def at(r, prompt):
                await asyncio.sleep(max(0.0, start + r.at_s - time.perf_counter()))
                return await _one(client, model, server, mode, r.output_tokens, prompt=prompt)

            return list(await asyncio.gather(*(at(r, p) for r, p in zip(plan.trace, plan.prompts))))

    outs = asyncio.run(go())
    _say(server, mode, "trace", outs)
    return server, mode, "trace", outs


def _say(server: str, mode: str, where: str, outs: list) -> None:
    from calid.placement import traffic as load

    ok = [o for o in outs if o.error is None]
    tok_s = load.score(outs, load.Slo(float("inf"), float("inf")))["tok_s"]
    retried = sum(1 for o in outs if o.retries)
    print(f"  {server} {mode} {where}: {tok_s:.2f} tok/s, {len(outs) - len(ok)} errors"
          + (f", {retried} requests sent again after a lost connection" if retried else ""), file=sys.stderr)
    for error, n in Counter(o.error for o in outs if o.error is not None).most_common():
        print(f"    {n} x {error}", file=sys.stderr)


def _rows(runs: list, slo_scale: float, limit: float, tokenizer=None) -> tuple[list[dict], object]:
    """One row per server, mode and load, from runs (server, mode, load, outcomes, round), scored against an SLO
    of ``slo_scale`` x calid ar's TTFT and TPOT p50 at the lowest concurrency (its requests of every round).
    tok_s: the median of the rounds; its ratio: the median of each round's ratio to calid ar's in that round;
    latencies and counts: every round's requests together; ngram_share (with a ``tokenizer``): ngram_share."""
    from calid.bench.ngram_bound import ngram_share
    from calid.placement import traffic as load

    def tok_s(outs):
        return load.score(outs, load.Slo(float("inf"), float("inf")))["tok_s"]

    points, spec = {}, {}  # (server, mode, load) -> {round: outcomes}, in the order first run; its counters
    for server, mode, where, outs, rnd, *counters in runs:
        points.setdefault((server, mode, where), {})[rnd] = outs
        for name, value in (counters[0] if counters else {}).items():
            spec.setdefault((server, mode, where), {}).setdefault(name, 0.0)
            spec[server, mode, where][name] += value
    low = next(v for (server, mode, _), v in points.items() if (server, mode) == ("calid", "ar"))
    base = load.score([o for outs in low.values() for o in outs], load.Slo(float("inf"), float("inf")))
    slo = load.Slo(slo_scale * base["ttft_ms_p50"] / 1000, slo_scale * base["tpot_ms_p50"] / 1000)
    rows = []
    for (server, mode, where), by_round in points.items():
        sc = load.score([o for outs in by_round.values() for o in outs], slo)
        ar = points.get(("calid", "ar", where), {})
        ratios = [tok_s(outs) / tok_s(ar[rnd]) if rnd in ar and tok_s(ar[rnd]) else float("nan")
                  for rnd, outs in sorted(by_round.items())]
        rows.append({"server": server, "mode": mode, "load": where, **{k: sc[k] for k in (
            "requests", "errors", "tokens", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "slo_met")},
            **_drafting(sc["tokens"], [o for outs in by_round.values() for o in outs], spec.get((server, mode, where))),
            "tok_s": statistics.median(tok_s(outs) for outs in by_round.values()),
            "tok_s_vs_calid_ar": statistics.median(ratios),
            "rounds_vs_calid_ar": " ".join(f"{r:.2f}" for r in ratios),
            "ngram_share": ngram_share(tokenizer, [o for outs in by_round.values() for o in outs]),
            "limit_tok_s": limit * int(where[1:]) if where.startswith("c") else "-"})
    return rows, slo


def _drafting(tokens: int, outcomes: list, counters: dict | None) -> dict:
    """draft_share: the output tokens that came from drafts (llama-server: its accepted draft tokens; calid: each
    answer's own count); spec_acceptance: llama-server's accepted / drafted tokens. "-" where not known."""
    drafted = [o.drafted for o in outcomes if o.error is None and o.drafted is not None]
    if counters and counters.get("drafted"):
        return {"draft_share": counters["accepted"] / tokens if tokens else "-",
                "spec_acceptance": counters["accepted"] / counters["drafted"]}
    if counters is not None and not drafted:  # a llama-server that drafted nothing
        return {"draft_share": 0.0, "spec_acceptance": "-"}
    return {"draft_share": sum(drafted) / tokens if drafted and tokens else "-", "spec_acceptance": "-"}


async def _closed_loop(url: str, model: str, mode: str, server: str, clients: int, prompts: list[str],
                       max_new: int, ignore_eos: bool) -> list:
    """Each of ``prompts`` once, by ``clients`` clients that each send their next when the last one ends."""
    from openai import AsyncOpenAI

    todo, out = list(range(len(prompts)))[::-1], []
    async with AsyncOpenAI(base_url=url, api_key="none", timeout=1800, max_retries=0) as client:
        async def worker():
            while todo:
                prompt = prompts[todo.pop()]
                out.append(await _one(client, model, server, mode, max_new, [{"role": "user", "content": prompt}],
                                      ignore_eos=ignore_eos))

        await asyncio.gather(*(worker() for _ in range(clients)))
    return out


async def _one(client, model: str, server: str, mode: str, max_new: int, messages: list | None = None,
               prompt: str | None = None, ignore_eos: bool = True):
    """One streamed request (a chat with ``messages``, else a raw completion of ``prompt``), greedy, EOS
    ignored unless ``ignore_eos`` is False; tokens from the usage the server reports at the end, else one per chunk
    with text. A request whose connection fails before the server answers is sent again, up to CONNECT_RETRIES
    times, as the openai SDK's default client does (the bench's client has its own retries off, so that no other
    error is hidden; a stream cut once it began stays an error); the time lost counts against its TTFT."""
    from openai import APIConnectionError, APITimeoutError

    from calid.placement.traffic import Outcome

    extra = {"ignore_eos": ignore_eos, **({"mode": mode} if server == "calid" else {})}
    common = dict(model=model, max_tokens=max_new, temperature=0, stream=True, extra_body=extra,
                  stream_options={"include_usage": True})
    sent = time.perf_counter()
    for attempt in range(CONNECT_RETRIES + 1):
        first, last, chunks, usage, pieces, drafted, answered = None, None, 0, None, [], None, False
        try:
            if messages is not None:
                stream = await client.chat.completions.create(messages=messages, **common)
            else:
                stream = await client.completions.create(prompt=prompt, **common)
            answered = True
            async for chunk in stream:
                if getattr(chunk, "usage", None) is not None:
                    usage = chunk.usage.completion_tokens
                calid = (chunk.model_extra or {}).get("calid")  # calid's stats ride on a stream's last chunk
                if isinstance(calid, dict):
                    drafted = (drafted or 0) + int(calid.get("draft_tokens", 0))
                choice = chunk.choices[0] if chunk.choices else None
                piece = choice and (choice.delta.content if messages is not None else choice.text)
                if piece:
                    pieces.append(piece)
                    last = time.perf_counter()
                    first = first or last
                    chunks += 1
        except Exception as e:  # noqa: BLE001 - counted in the row's errors
            lost = isinstance(e, APIConnectionError) and not isinstance(e, APITimeoutError)
            if lost and not answered and attempt < CONNECT_RETRIES:
                continue
            return Outcome(sent, first, last, chunks, error=_failure(e, chunks), retries=attempt)
        break
    tokens = usage if usage else chunks
    # llama_cpp.server under concurrent requests ends some streams with no content and no error
    return Outcome(sent, first, last, tokens, error=None if chunks else "the stream ended with no tokens",
                   prompt=messages[-1]["content"] if messages else "", text="".join(pieces), drafted=drafted,
                   retries=attempt)


def _failure(e: Exception, chunks: int) -> str:
    return f"{type(e).__name__}: {e}" + (f" (after {chunks} tokens)" if chunks else "")


def _plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["server"], r["mode"]) for r in rows}):
        pts = sorted((int(r["load"][1:]), r["tok_s"]) for r in rows
                     if (r["server"], r["mode"]) == key and r["load"].startswith("c"))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=" ".join(key))
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs concurrency, one OpenAI client")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
