"""``calid bench soak``: a long day of mixed traffic with faults, on a server this command starts.

For --duration (any length; 30m by default) a few concurrent users send, at random: gRPC and HTTP requests,
streaming and not, in every mode, of short, medium and long answers; streams the client stops after a few chunks
(gRPC cancels, HTTP disconnects); bad requests; and now and then a burst over the admission limit. Every few
minutes a draft replica, then a target replica, is killed (topology split; with engine, the router replica).
Every completed greedy answer is checked token for token against the reference decoded alone before the soak
(the server runs batch-invariant forwards, meant to make the reference hold at any load; --no-exact turns the
forwards and the check off). An answer that differs is kept with the target's margin where it first differs
(the reference's top logprob minus the token taken instead, from the reference's logprobs): within
NEAR_TIE_NATS it is a near-tie a batch's rounding can flip; farther, or a token outside the target's top two, it
is counted as wrong (what lost or corrupted state would do), apart from tokens missing. A filter answer is judged
by tokens missing only: each of its tokens comes from the draft or the target by the draft's confidence against
the threshold, which the reference's (target) logprobs do not show, so where it differs it is kept and counted,
marked as a filter switch, and not called wrong. Every --sample-every,
each process's RSS (and its private anonymous part) and the router's queue / active / KV gauges are recorded.
At the end: served, refused by reason, failed in and outside the kill windows, tokens missing, answers not
identical to the reference (and of them, not at a near-tie), each process's RSS slope in % and MB per hour,
the gauges back at zero, latency p50/p99 early against late; a PNG of the gauges and of RSS over time, and a
JSON of everything.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

DEFAULT_MODES = ("ar", "speculative", "tree", "lookahead", "auto", "filter")
LENGTHS = (16, 64, 160)  # max_new_tokens of a request: short, medium, long
MIX = {"grpc-stream": 30, "grpc-unary": 15, "http-stream": 15, "http-unary": 10, "grpc-cancel": 10,
       "http-disconnect": 10, "bad-request": 10}  # what a user sends next, by weight
JUDGED_LIFE_S = 600.0  # a process's memory is judged on at least this long after its warm-up
RETRY_AFTER_S = 1.0  # a user refused for a full server waits this long before its next request


def add_parser(sub) -> None:
    p = sub.add_parser("soak", help="hours of mixed traffic with replica kills: nothing lost, memory flat, idle "
                                    "at the end")
    p.add_argument("--duration", default="30m", help="how long to send traffic: 90s, 30m, 2h (default 30m)")
    p.add_argument("--small", action="store_true", help="SmolLM2-135M with self:16 instead of the Qwen pair")
    p.add_argument("--topology", default="split", choices=("split", "engine"),
                   help="split (default): draft and target replicas to kill; engine: the router replica is killed")
    p.add_argument("--users", type=int, default=4, help="concurrent users (default 4)")
    p.add_argument("--prompts", type=int, default=6, help="distinct prompts (code, edits, chat in turn), each "
                   "decoded alone first as the reference (default 6)")
    p.add_argument("--kill-every", default="5m", help="a replica killed this often (default 5m; 0: never)")
    p.add_argument("--burst-every", default="4m", help="a burst over the admission limit this often (default 4m)")
    p.add_argument("--kill-window", default="60s", help="failures this long after a kill count against the retry "
                   "budget, not as failures (default 60s)")
    p.add_argument("--sample-every", default="5s", help="RSS and gauges sampled this often (default 5s)")
    p.add_argument("--max-slope-pct", type=float, default=5.0, help="RSS growth per hour that fails (default 5)")
    p.add_argument("--no-exact", action="store_true", help="no batch-invariant forwards (faster; greedy answers "
                   "then depend on their batch and are not checked)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=50071)
    p.add_argument("--http-port", type=int, default=8071)
    p.add_argument("--out", default="bench_results")
    p.set_defaults(func=run)


def run(args) -> int:
    from calid.backends import cpu_summary
    from calid.bench.soak_report import parse_duration
    from calid.errors import CalidError
    from serve_app.cluster.config import AppConfig
    from serve_app.cluster.local import serve_app, shutdown

    plan = {k: parse_duration(getattr(args, k), k) for k in ("duration", "kill_every", "burst_every", "kill_window",
                                                            "sample_every")}
    if plan["duration"] <= 0 or plan["sample_every"] <= 0 or args.users < 1 or args.prompts < 1:
        raise CalidError("--duration and --sample-every must be > 0, --users and --prompts >= 1")
    cfg = (AppConfig.small if args.small else AppConfig)(
        app_name="soak", grpc_port=args.port, http_port=args.http_port, topology=args.topology, max_active=8,
        queue_capacity=16, batch_invariant=not args.no_exact)
    checked = "batch-invariant (answers checked)" if cfg.batch_invariant else "answers not checked (--no-exact)"
    print(f"bench soak: target {cfg.target}, draft {cfg.draft}, topology {cfg.topology}, {checked}; "
          f"{args.users} users for {args.duration}, a kill every {args.kill_every}, a burst every "
          f"{args.burst_every}", file=sys.stderr)
    print(f"machine: {cpu_summary()}", file=sys.stderr)
    started = time.monotonic()
    serve_app(cfg, dashboard=False)
    try:
        print(f"bench soak: server up in {time.monotonic() - started:.0f} s", file=sys.stderr)
        soak = _Soak(cfg, args, plan)
        soak.references()
        result = soak.run()
        return _report(result, args)  # written before the server stops: however the stop goes, nothing is lost
    finally:
        shutdown()


class _Soak:
    def __init__(self, cfg, args, plan: dict):
        from ray import serve

        from calid.bench.data import mixed_prompts
        from calid.bench.soak_report import Tally

        self.cfg, self.args, self.plan = cfg, args, plan
        self.address = f"127.0.0.1:{cfg.grpc_port}"
        self.base_url = f"http://127.0.0.1:{cfg.http_port}/v1"
        self.detokenize_url = f"http://127.0.0.1:{cfg.http_port}/detokenize"
        self.router = serve.get_deployment_handle("router", cfg.app_name)
        self.modes = [m for m in DEFAULT_MODES if cfg.draft is not None or m in ("ar", "lookahead", "auto")]
        self.prompts = mixed_prompts(args.prompts)
        # (prompt, ar | filter) -> ids, text, and at each position the target's top two (token, logprob)
        self.refs: dict[tuple[int, str], tuple[list[int], str, list[list[tuple[int, float]]]]] = {}
        self.tally = Tally()
        self.samples: list[dict] = []
        self.mismatches: list[dict] = []  # completed greedy answers that are not the reference's, and where
        self.rss: dict[str, list[tuple[float, float]]] = {}  # "role[pid]" -> (t, bytes)
        self.anon: dict[str, list[tuple[float, float]]] = {}  # the same, of private anonymous memory only
        self.rng = random.Random(args.seed)
        self.t0 = 0.0
        self.step_ms: float | None = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    def references(self) -> None:
        """Each prompt's greedy answer, alone, at the longest length: ar's (every lossless mode's) and filter's."""
        from calid.client import Client
        from calid.progress import progress

        classes = ["ar"] + (["filter"] if "filter" in self.modes else [])
        with Client(self.address, app=self.cfg.app_name, timeout=1800) as c, \
                progress(len(self.prompts) * len(classes), "bench soak", "reference") as bar:
            for i, prompt in enumerate(self.prompts):
                for mode in classes:  # with the target's top two at each position: where a difference is a tie
                    done = c.generate(prompt, mode=mode, max_new_tokens=max(LENGTHS), logprobs=2)
                    self.refs[i, mode] = (done.token_ids, done.text, [lp.top for lp in done.logprobs])
                    bar.update(1)
            t = time.perf_counter()  # the plain step, as users' requests (no logprobs) get it
            done = c.generate(self.prompts[0], mode="ar", max_new_tokens=max(LENGTHS))
        self.step_ms = 1000 * (time.perf_counter() - t) / max(1, len(done.token_ids))
        print(f"bench soak: ar alone, served: {self.step_ms:.1f} ms per output token (prefill included; "
              f"{len(done.token_ids)} tokens)", file=sys.stderr)

    def run(self) -> dict:
        stop = threading.Event()
        self.t0 = time.monotonic()
        sampler = threading.Thread(target=self._sample_until, args=(stop,), daemon=True)
        sampler.start()
        try:
            asyncio.run(self._traffic())
            idle = self._wait_idle()
        finally:
            stop.set()
            sampler.join(30)
        return {"tally": self.tally, "samples": self.samples, "rss": self.rss, "anon": self.anon, "idle": idle,
                "mismatches": self.mismatches, "kill_window_s": self.plan["kill_window"],
                "duration_s": self.plan["duration"], "step_ms": self.step_ms, "cfg": self.cfg}

    # ---- traffic ---------------------------------------------------------------------------------

    async def _traffic(self) -> None:
        import httpx

        from calid.client import AsyncClient

        end = self.plan["duration"]
        async with AsyncClient(self.address, app=self.cfg.app_name, timeout=900) as grpc_client, \
                httpx.AsyncClient(base_url=self.base_url, timeout=900) as http:
            users = [self._user(grpc_client, http, end) for _ in range(self.args.users)]
            await asyncio.gather(*users, self._kills(end), self._bursts(end))

    async def _user(self, c, http, end: float) -> None:
        kinds, weights = list(MIX), list(MIX.values())
        while self.now() < end:
            kind = self.rng.choices(kinds, weights)[0]
            await getattr(self, "_" + kind.replace("-", "_"))(c, http)
            last = self.tally.records[-1] if self.tally.records else None
            if last is not None and last.reason in ("RESOURCE_EXHAUSTED", "HTTP 429"):
                await asyncio.sleep(RETRY_AFTER_S)  # as a client honouring the refusal's Retry-After does

    def _pick(self) -> tuple[int, str, int]:
        return (self.rng.randrange(len(self.prompts)), self.rng.choice(self.modes), self.rng.choice(LENGTHS))

    def _check(self, i: int, mode: str, limit: int, ids: list[int], finish: str) -> tuple[int, bool, bool]:
        """(tokens missing, differs, differs past a near-tie) of a completed gRPC answer against its reference;
        a difference is kept, with the target's margin where it first differs."""
        from calid.bench.soak_report import compare

        if not self.cfg.batch_invariant:
            return 0, False, False
        ref, _, tops = self.refs[i, "filter" if mode == "filter" else "ar"]
        missing, at = compare(ids, ref, limit, eos=finish == "eos")
        if not missing and at is None:
            return 0, False, False
        wrong = self._differs("grpc", mode, i, limit, len(ids), tops, at, ids[at] if at is not None and at < len(ids)
                              else None, {"first_difference": at, "missing": missing})
        return missing, at is not None, wrong

    def _differs(self, api: str, mode: str, i: int, limit: int, got: int, tops: list, at: int | None,
                 taken: int | None, where: dict) -> bool:
        """Keep an answer that is not the reference's; whether it differs where the target's choice was not a
        near-tie (what batch rounding cannot explain)."""
        from calid.bench.soak_report import is_near_tie, tie_margin

        margin = tie_margin(tops[at], taken) if at is not None and at < len(tops) else None
        switch = mode == "filter"  # the draft's confidence chose the token's source: the target's margin cannot tell
        self.mismatches.append({"t": round(self.now(), 1), "api": api, "mode": mode, "prompt": i, "limit": limit,
                                "got": got, "reference": min(limit, len(tops)), **where,
                                "margin_nats": None if margin is None else round(margin, 4),
                                **({"filter_switch": True} if switch else {})})
        return at is not None and not switch and not is_near_tie(margin)

    async def _timed(self, kind: str, call):
        """Run ``call()`` (returns tokens, (missing, differs, wrong), ttft_s) and record its outcome."""
        from calid.bench.soak_report import CUT, FAILED, REFUSED, SERVED, Record
        from calid.client import CalidAPIError

        start = self.now()
        tokens, check, ttft, outcome, reason = 0, (0, False, False), None, SERVED, ""
        try:
            tokens, check, ttft = await call()
        except _Cut:
            outcome = CUT
        except CalidAPIError as e:
            reason = e.code.name if e.code is not None else type(e).__name__
            outcome = REFUSED if reason in ("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT") else FAILED
        except _HttpStatus as e:
            reason = f"HTTP {e.status}"
            outcome = REFUSED if e.status in (400, 404, 413, 422, 429) else FAILED
        except Exception as e:  # a transport error is a failure like any other, kept with its kind
            outcome, reason = FAILED, type(e).__name__
        self.tally.add(Record(kind, start, self.now(), outcome, reason, tokens, lost=check[0], differs=check[1],
                              wrong=check[2], ttft_s=ttft))

    async def _grpc_stream(self, c, http) -> None:
        i, mode, limit = self._pick()

        async def call():
            ids, ttft, t, finish = [], None, time.monotonic(), ""
            async for chunk in c.stream(self.prompts[i], mode=mode, max_new_tokens=limit):
                ttft = ttft if ttft is not None else time.monotonic() - t
                ids += chunk.token_ids
                finish = chunk.finish_reason or finish
            return len(ids), self._check(i, mode, limit, ids, finish), ttft

        await self._timed("grpc-stream", call)

    async def _grpc_unary(self, c, http) -> None:
        i, mode, limit = self._pick()

        async def call():
            done = await c.generate(self.prompts[i], mode=mode, max_new_tokens=limit)
            return len(done.token_ids), self._check(i, mode, limit, done.token_ids, done.finish_reason), None

        await self._timed("grpc-unary", call)

    async def _grpc_cancel(self, c, http) -> None:
        i, mode, limit = self._pick()

        async def call():
            chunks = 0
            async for _ in c.stream(self.prompts[i], mode=mode, max_new_tokens=max(LENGTHS), ignore_eos=True):
                chunks += 1
                if chunks == 2:
                    break  # the SDK cancels the call and tells the server
            raise _Cut

        await self._timed("grpc-cancel", call)

    def _chat(self, i: int, mode: str, limit: int, stream: bool) -> dict:
        body = {"model": self.cfg.served_model or _served(self.cfg), "max_tokens": limit, "temperature": 0,
                "messages": [{"role": "user", "content": self.prompts[i]}], "mode": mode, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def _text_check(self, http, i: int, mode: str, limit: int, text: str, tokens: int, finish: str
                          ) -> tuple[int, bool, bool]:
        """As _check for an HTTP answer (its text, token count and finish reason): the reference's beginning, as
        long; where it differs, in the reference's tokens."""
        if not self.cfg.batch_invariant:
            return 0, False, False
        ids, ref_text, tops = self.refs[i, "filter" if mode == "filter" else "ar"]
        want = min(limit, len(ids))
        if ref_text.startswith(text) and tokens == want:
            return 0, False, False
        char = next((k for k, (a, b) in enumerate(zip(text, ref_text)) if a != b), None)
        if char is None and len(text) > len(ref_text):
            char = len(ref_text)  # went on where the reference ended
        if char is None and tokens < want and finish != "stop":
            missing, at = want - tokens, None  # the reference's beginning, cut short without an EOS: lost
        else:
            missing, at = 0, await self._token_at(http, ids, len(text) if char is None else char)
        c = char if char is not None else len(text)
        wrong = self._differs("http", mode, i, limit, tokens, tops, at, None,
                              {"first_difference": at, "first_difference_char": char, "missing": missing,
                               "got_text": text[max(0, c - 40):c + 40],
                               "reference_text": ref_text[max(0, c - 40):c + 40]})
        return missing, at is not None, wrong

    async def _token_at(self, http, ids: list[int], char: int) -> int:
        """The reference token whose text holds character ``char`` of the reference's text (len(ids): past its
        end), by bisection over the server's own /detokenize."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            r = await http.post(self.detokenize_url, json={"tokens": ids[:mid + 1]})
            if len(r.json()["prompt"]) > char:
                hi = mid
            else:
                lo = mid + 1
        return lo

    async def _http_stream(self, c, http) -> None:
        i, mode, limit = self._pick()

        async def call():
            text, tokens, ttft, t, finish = [], 0, None, time.monotonic(), ""
            async with http.stream("POST", "/chat/completions", json=self._chat(i, mode, limit, True)) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise _HttpStatus(r.status_code)
                async for line in r.aiter_lines():
                    event = _sse_event(line)
                    if event is None:
                        continue
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    for choice in event.get("choices") or []:
                        finish = choice.get("finish_reason") or finish
                        piece = (choice.get("delta") or {}).get("content") or ""
                        if piece and ttft is None:
                            ttft = time.monotonic() - t
                        text.append(piece)
            return tokens, await self._text_check(http, i, mode, limit, "".join(text), tokens, finish), ttft

        await self._timed("http-stream", call)

    async def _http_unary(self, c, http) -> None:
        i, mode, limit = self._pick()

        async def call():
            r = await http.post("/chat/completions", json=self._chat(i, mode, limit, False))
            if r.status_code != 200:
                raise _HttpStatus(r.status_code)
            body = r.json()
            tokens = body["usage"]["completion_tokens"]
            text = body["choices"][0]["message"]["content"] or ""
            finish = body["choices"][0].get("finish_reason") or ""
            return tokens, await self._text_check(http, i, mode, limit, text, tokens, finish), None

        await self._timed("http-unary", call)

    async def _http_disconnect(self, c, http) -> None:
        i, mode, _ = self._pick()

        async def call():
            body = self._chat(i, mode, max(LENGTHS), True) | {"ignore_eos": True}
            async with http.stream("POST", "/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise _HttpStatus(r.status_code)
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == 2:
                        break  # leaving the block closes the connection mid-stream
            raise _Cut

        await self._timed("http-disconnect", call)

    async def _bad_request(self, c, http) -> None:
        which = self.rng.randrange(3)

        async def call():
            if which == 0:
                await c.generate(self.prompts[0], max_new_tokens=10**7)
            elif which == 1:
                await c.generate(self.prompts[0], mode="no-such-mode", max_new_tokens=4)
            else:
                r = await http.post("/chat/completions", content=b'{"messages": [', headers={
                    "content-type": "application/json"})
                raise _HttpStatus(r.status_code)
            raise AssertionError("a bad request was served")

        await self._timed("bad-request", call)

    # ---- faults and bursts -----------------------------------------------------------------------

    async def _kills(self, end: float) -> None:
        every = self.plan["kill_every"]
        if every <= 0:
            return
        roles = ["draft", "target"] if self.cfg.topology == "split" and self.cfg.draft else (
            ["target"] if self.cfg.topology == "split" else ["router"])
        n = 1
        while n * every < end:
            await asyncio.sleep(max(0.0, n * every - self.now()))  # on the clock, however long a kill took
            role = roles[(n - 1) % len(roles)]
            n += 1
            at = self.now()  # requests in flight from here on count against the retry budget
            if await asyncio.get_running_loop().run_in_executor(None, _kill_replica, self.cfg.app_name, role):
                self.tally.kills.append((at, role))
                print(f"bench soak: {at:.0f} s: killed a {role} replica ({self.now() - at:.1f} s to kill)",
                      file=sys.stderr, flush=True)

    async def _bursts(self, end: float) -> None:
        from calid.client import AsyncClient

        every = self.plan["burst_every"]
        if every <= 0:
            return
        size = self.cfg.max_active + self.cfg.queue_capacity + 16
        async with AsyncClient(self.address, app=self.cfg.app_name, timeout=900, retries=0) as c:
            while self.now() + every < end:
                await asyncio.sleep(every)

                async def one():
                    async def call():
                        done = await c.generate(self.prompts[1], mode="ar", max_new_tokens=8)
                        return len(done.token_ids), (0, False, False), None
                    await self._timed("burst", call)

                await asyncio.gather(*(one() for _ in range(size)))

    # ---- what the server holds -------------------------------------------------------------------

    def _sample_until(self, stop: threading.Event) -> None:
        said = 0.0
        while not stop.wait(self.plan["sample_every"]):
            self._sample()
            if self.now() - said >= 60:  # a line a minute: a long soak shows where it is
                said = self.now()
                self._progress()

    def _progress(self) -> None:
        c = self.tally.counts(self.plan["kill_window"])
        g = self.samples[-1] if self.samples else {}
        at = (f"{self.now() / 60:5.1f} of {self.plan['duration'] / 60:.1f} min" if self.now() < self.plan["duration"]
              else f"{self.now() / 60:5.1f} min, no new requests since {self.plan['duration'] / 60:.1f}")
        print(f"bench soak: {at}: {c['served']} served "
              f"({c['tokens']} tokens), {sum(c['refused'].values())} refused, {c['failed_in_kill_windows']} + "
              f"{c['failed_outside_kill_windows']} failed (in + outside kill windows), {c['lost_tokens']} tokens "
              f"missing, {c['answers_not_identical']} answers not the reference's "
              f"({c['not_identical_past_a_near_tie']} past a near-tie); "
              f"router active {g.get('active')}, waiting {g.get('waiting')}", file=sys.stderr, flush=True)

    def _sample(self) -> None:
        import psutil

        t = self.now()
        for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
            try:
                name = f"{_role(p)}[{p.pid}]"
                self.rss.setdefault(name, []).append((t, float(p.memory_info().rss)))
                anon = _rss_anon(p.pid)
                if anon is not None:
                    self.anon.setdefault(name, []).append((t, anon))
            except psutil.Error:
                pass
        self.samples.append({"t": t, **self._gauges()})

    def _gauges(self) -> dict:
        """The router's queue, active requests, requests it holds, and the live KV caches of its workers
        (None where a replica did not answer: one being replaced)."""
        out = {"waiting": None, "active": None, "requests": None, "target_kv": None, "draft_kv": None}
        try:
            s = self.router.stats.remote().result(timeout_s=10)
            out.update(waiting=s["waiting"], active=s["active"], requests=s["requests"])
            w = self.router.worker_stats.remote().result(timeout_s=10)
            out.update(target_kv=w.get("target", {}).get("cached"), draft_kv=w.get("draft", {}).get("cached"))
        except Exception:  # a replica being replaced: this sample has gaps
            pass
        return out

    def _wait_idle(self, timeout_s: float = 120) -> dict:
        """After the last request: wait until the router and its workers hold nothing; what is left."""
        end = time.monotonic() + timeout_s
        gauges = self._gauges()
        while time.monotonic() < end:
            gauges = self._gauges()
            if all(v == 0 for v in gauges.values() if v is not None) and gauges["requests"] is not None:
                break
            time.sleep(2)
        return {k: v for k, v in gauges.items() if v is not None}


class _Cut(Exception):
    """The client stopped the request on purpose (a cancel, a disconnect)."""


class _HttpStatus(Exception):
    def __init__(self, status: int):
        super().__init__(f"HTTP {status}")
        self.status = status


def _sse_event(line: str) -> dict | None:
    """One line of an OpenAI event stream: its event, or None (not an event, or [DONE]). An error after the
    first byte comes as an ``{"error": ...}`` event (the status is already 200): that is the request's outcome,
    raised as its HTTP code, not an answer that stopped short."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    event = json.loads(line[6:])
    if isinstance(event.get("error"), dict):
        raise _HttpStatus(int(event["error"].get("code") or 500))
    return event


def _served(cfg) -> str:
    from calid.models.source import served_name

    return served_name(cfg.target)


def _role(p) -> str:
    """A process's role from its title: the bench itself, a Serve replica (soak:target), another Ray process."""
    if p.pid == os.getpid():
        return "bench"
    title = " ".join(p.cmdline()[:1]) or p.name()
    if "ServeReplica:" in title:  # ray::ServeReplica:soak:target[.method it runs now]
        return title.split("ServeReplica:", 1)[1].split()[0].split(".")[0]
    return title[5:].split()[0].split(".")[0] if title.startswith("ray::") else p.name()


def _rss_anon(pid: int) -> float | None:
    """A process's private anonymous memory (what a leak grows; RSS also counts pages of its program and
    libraries read in as new code runs), from /proc on Linux; None elsewhere."""
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next((x for x in f if x.startswith("RssAnon:")), None)
    except OSError:
        return None
    return None if line is None else float(line.split()[1]) * 1024


def _kill_replica(app: str, role: str) -> bool:
    import ray
    from ray.util import list_named_actors

    names = [a["name"] for a in list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{app}#{role}#")]
    if not names:
        return False
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)  # Serve starts a fresh replica
    return True


def _report(result: dict, args) -> int:
    from calid.bench.soak_report import latency_windows, rss_slope_pct_per_hour, verdicts

    tally, duration = result["tally"], result["duration_s"]
    counts = tally.counts(result["kill_window_s"])
    # a process's warm-up is left out of its slope: Ray's own raylet grows for about 40 minutes after it starts,
    # then stays flat (docs/benchmark-log.md, 2026-12-02 night); a third of the run leaves 40 min of a 2-hour soak
    skip = max(60.0, duration / 3)
    judged_life = JUDGED_LIFE_S
    slopes, anon, lives = {}, {}, {}
    for name, pts in result["rss"].items():
        lives[name] = pts[-1][0] - pts[0][0] if pts else 0.0
        slopes[name] = rss_slope_pct_per_hour(pts, skip)
        anon[name] = _mb_per_hour(result["anon"].get(name, []), skip)
    judged = {k: v for k, v in slopes.items() if lives[k] - skip >= judged_life}
    window = min(600.0, duration / 3)
    latency = latency_windows(tally.records, duration, window)
    bad = verdicts(counts, judged, result["idle"], args.max_slope_pct)
    print(f"\nbench soak ({duration:.0f} s of traffic; ar alone, served: {result['step_ms'] or 0:.1f} ms per token):")
    for key in ("requests", "served", "tokens", "cut_by_client", "refused", "failed_in_kill_windows",
                "failed_outside_kill_windows", "lost_tokens", "answers_not_identical", "not_identical_past_a_near_tie",
                "by_kind"):
        print(f"  {key:28} {counts[key]}")
    print(f"  {'kills':28} {[f'{t:.0f}s {r}' for t, r in tally.kills]}")
    print(f"  {'at the end (0 = idle)':28} {result['idle']}")
    for name in ("first", "last"):
        w = latency[name]
        print(f"  latency, {name} {window:.0f} s: {w['requests']} requests, p50 {_s(w['p50_s'])}, p99 {_s(w['p99_s'])}")
    print(f"  RSS slope, % and MB per hour, and of its private anonymous part (after each process's first {skip:.0f} "
          f"s; judged on processes that lived {judged_life / 60:.0f} min more; '-': too short a life to tell):")
    for name, slope in sorted(slopes.items(), key=lambda kv: -max(m for _, m in result["rss"][kv[0]])):
        pts = result["rss"][name]
        peak = max(m for _, m in pts) / 2**20
        rss_h = _mb_per_hour(pts, skip)
        mb_h = "" if rss_h is None else f"{rss_h:+8.1f} MB/h"
        anon_h = "" if anon[name] is None else f"anon {anon[name]:+7.1f} MB/h"
        life = "" if name in judged else f"   (lived {lives[name] / 60:.0f} min: not judged)"
        print(f"    {name:36} {'-' if slope is None else f'{slope:+.2f}%':>8} {mb_h:>12} {anon_h:>18}   "
              f"peak {peak:6.0f} MB{life}")
    for m in result["mismatches"][:8]:
        print(f"  not the reference: {m}")
    print("verdict: " + ("PASS" if not bad else "FAIL\n  " + "\n  ".join(bad)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    data = {"counts": counts, "kills": tally.kills, "idle": result["idle"], "latency": latency, "slopes": slopes,
            "anon_mb_per_hour": anon, "samples": result["samples"], "rss": result["rss"], "anon": result["anon"],
            "verdict": bad,
            "mismatches": result["mismatches"], "duration_s": duration,
            "ar_alone_ms_per_token": result["step_ms"], "target": result["cfg"].target, "draft": result["cfg"].draft}
    (out / f"soak-{stamp}.json").write_text(json.dumps(data, indent=1))
    png = _plot(result, out / f"soak-{stamp}.png")
    print(f"written: {out / f'soak-{stamp}.json'}" + (f", {png}" if png else ""))
    return 0 if not bad else 1


def _mb_per_hour(pts: list[tuple[float, float]], skip_s: float) -> float | None:
    from calid.bench.soak_report import rss_slope_pct_per_hour

    pct = rss_slope_pct_per_hour(pts, skip_s)
    return None if pct is None else pct / 100 * statistics.fmean(m for _, m in pts) / 2**20


def _s(x) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _plot(result: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    samples = result["samples"]
    for key in ("waiting", "active", "requests", "target_kv", "draft_kv"):
        pts = [(s["t"] / 60, s[key]) for s in samples if s.get(key) is not None]
        if pts:
            top.plot(*zip(*pts), label=key)
    top.set_ylabel("router gauges")
    top.legend(loc="upper right", fontsize=8)
    for name, pts in result["rss"].items():
        if max(m for _, m in pts) > 150 * 2**20:  # the processes that hold models or much state
            bottom.plot([t / 60 for t, _ in pts], [m / 2**20 for _, m in pts], label=name)
    bottom.set_ylabel("RSS (MB)")
    bottom.set_xlabel("minutes")
    bottom.legend(loc="upper left", fontsize=7)
    for t, role in result["tally"].kills:
        for ax in (top, bottom):
            ax.axvline(t / 60, color="red", alpha=0.3)
    fig.suptitle("calid bench soak: gauges and memory over time (red: a replica killed)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
