"""The router deployment: one model's request path and step loop (its gRPC and HTTP entry points are
serve_app.ingress.grpc.GrpcFront, which it inherits).

The request path every front-end uses: ``open`` (authorize, validate: INVALID_ARGUMENT naming the field; admit
into a bounded queue: RESOURCE_EXHAUSTED when full), ``events`` (what the step loop delivers), ``close`` (free
it), ``cancel``, ``refuse``, ``wake``. The step loop decodes every active request together (calid.orchestrator):
per step at most one draft call and one target call per worker replica, each request's to the replica that holds
its KV caches (serve_app.router.calls). Confident filter drafts are appended and streamed before the target call
(early acceptance); the escalations of all requests go to the target in one batch. The router's token ids are the
source of truth: a failed worker call is retried (any replica recomputes from the ids), and only after
``worker_call_retries`` does the request fail with UNAVAILABLE.

Collaborate requests (serve_app.ingress.collaborate) are drafted by their clients: they join a step only once the
client's round has arrived, and that round stands in for the draft worker's result.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import grpc
from ray import serve

from calid.hugepages import describe as pages
from calid.admission import Backlog, budget_left
from calid.decoding.budget import starting_table
from calid.decoding.quality_budget import table_for
from calid.decoding.modes import MODES
from calid.edge import EdgeRound, round_draft
from calid.errors import CalidError, InvalidRequestError, UncalibratedError
from calid.generation import GenerationRequest, RequestState, StreamEvent
from calid.models.config import ModelConfig
from calid.models.loader import eos_token_ids, load_tokenizer
from calid.models.source import served_name
from calid.backends import model_facts
from calid.runtime.llamacpp import slot_cells
from calid.orchestrator import DraftCall, Orchestrator, VerifyCall, advance
from calid.scaling import RateWindow
from calid.v1 import calid_pb2 as pb
from serve_app.cluster.config import ConfigError, load_config
from serve_app.ingress import protocol
from serve_app.ingress.auth import AuthConfigError, allowed, load_keys
from serve_app.ingress.frontdoor import FRONTENDS, Caller, Refused
from serve_app.ingress.grpc import GrpcFront
from serve_app.ingress.outputs import IDLE
from serve_app.router.calls import Failure, RoundEnd, WorkerCalls, WorkersUnavailable, answered, in_process
from serve_app.router.metrics import RouterMetrics, meets_slo

log = logging.getLogger("ray.serve")
COST_EXPORT_STEPS = 32  # the cost model goes to the metrics every this many steps
# a draft call that fails for a lost replica is not retried: the step goes on without it at once (a retry
# would wait in Serve's handle for a replacement replica to start: 6-12 s measured in tests/multinode)
DRAFT_RETRIES = 0
DRAFT_PROBE_S = 2.0  # while the draft is unreachable, ask this often (in the background) whether it is back
CALIBRATION_PINGS = 5  # no-op calls timed per worker role at calibration: what a call costs beside its forward
STATS_TIMEOUT_S = 5.0  # worker_stats leaves out a worker that does not answer within this
RETRY_AFTER_S = 1.0  # what a refusal for a full queue tells the client to wait (HTTP Retry-After)
# inline workers (_let_streams_take): loop turns after a step for its streams to take their events; a reader in
# process needs 2 after its queue is empty (the getter task, wait_for, the front-end: tests/serve/test_inline_workers);
# one more is a margin for Serve's replica wrapper, not measured
STREAM_TURNS, STREAM_TURNS_AFTER = 16, 3


@dataclass
class _Request:
    """Router-side handle of one request: its client id, mode and the channel its events go to."""

    client_id: str
    mode: str
    req: GenerationRequest
    deadline: float  # monotonic time by which it must finish (request_timeout_s)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    seen: tuple[int, int] = (0, 0)  # draft/target tokens already counted in the rate window
    owner: str | None = None  # the caller's API key, when keys are on: only its owner may cancel it
    edge: bool = False  # the client drafts (Collaborate): its steps wait for the client's rounds
    round: EdgeRound | None = None  # an edge request's draft round, until a step has used it
    arrived: float = field(default_factory=time.perf_counter)  # its TTFT counts from here (queueing included)
    frontend: str = "grpc"  # grpc | edge | http (a metric label)
    logprobs: int | None = None  # score the output: this many alternatives per token (None: no logprobs)
    echo: bool = False  # score the prompt too
    score_only: bool = False  # echo with max_new_tokens = 0: the prompt is scored, nothing decoded


@serve.deployment(name="router", max_ongoing_requests=1024)
class Router(GrpcFront):
    def __init__(self, config, draft=None, target=None):
        self.cfg = load_config(config)
        if self.cfg.topology == "engine" and draft is None and target is None:
            from serve_app.workers.colocated import colocated_workers

            draft, target = colocated_workers(self.cfg.model_dump())  # no process hop per step
        self.draft, self.target = draft, target
        # the workers' forwards run on this loop's thread (serve_app.workers.colocated): the step loop yields after
        # every step (_loop), or the step's events would wait for the next forward to end
        self._inline = in_process(target)
        self._run_left = 0  # inline: steps left in the run of plain steps this step belongs to (_count_run)
        self._held: list[StreamEvent] = []  # inline: the run's tokens so far, delivered at its last step
        backend, folder = model_facts(self.cfg.target, self.cfg.target_backend, self.cfg.target_on, self.cfg.sharded,
                                      show_progress=False)
        model_cfg = ModelConfig.from_dir(folder)
        self.tokenizer = load_tokenizer(folder)
        self.vocab_size, self.max_position = model_cfg.vocab_size, model_cfg.max_position
        self.model_id = self.cfg.served_model or served_name(self.cfg.target)
        self.started = time.time()
        if backend == "llamacpp":  # a llama.cpp slot holds at most this many tokens of one sequence
            self.max_position = slot_cells(model_cfg, self.cfg.kv_budget_mb and self.cfg.kv_budget_mb * 2**20)
        self.orch = Orchestrator(self.tokenizer, eos_token_ids(folder, self.tokenizer), self.max_position,
                                 has_draft=draft is not None)
        self.orch.sliced = backend == "llamacpp"
        self.orch.padding = not self.cfg.batch_invariant  # exact forwards are fed exactly as given
        self.orch.default_decode = replace(self.orch.default_decode, mode=self.cfg.default_mode or
                                           self.orch.default_decode.mode, filter_threshold=self.cfg.filter_point)
        self.orch.audit_every = self.cfg.agreement_audit_every
        try:
            self.orch.agreement, self.agreement_calibration = starting_table(self.cfg.target, self.cfg.draft)
            self.quality = (table_for(self.cfg.target, self.cfg.draft, self.cfg.quality_table) if self.cfg.draft
                            else None)  # max_quality_loss's table and where it came from
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self._id = uuid.uuid4().hex[:8]
        self._n = 0
        self._requests: dict[str, _Request] = {}  # internal id -> request
        self._waiting: deque[str] = deque()
        self._cancelled: set[str] = set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._rates = RateWindow()
        self._backlog = Backlog(self.cfg.request_timeout_s)  # admission by expected finish time
        self._refused_late = 0  # requests refused because the work ahead would outlast their timeout
        self._metrics = RouterMetrics()
        self._steps = 0
        self._slo = {True: 0, False: 0}  # finished requests that met / missed the model's SLO
        self._step_s = 0.0  # time in steps (the rest of it is spent in worker calls: stats()["call_s"])
        self._max_escalation = 0
        self._in_runs: set[str | None] = set()  # target replicas running this step's runs of plain steps
        self._calibration: asyncio.Task | None = None  # the workers' forward costs, measured once (calibration)
        self.call_overhead_s: dict[str, float] = {}  # a no-op call's round trip per worker role, at calibration
        self._draft_probe: asyncio.Task | None = None
        self._draft_lost = 0  # times the draft could not be reached
        self._metrics.draft_available.set(1 if draft is not None else 0)
        try:
            self._keys = load_keys(self.cfg.api_keys_file, self.cfg.api_keys_env)
        except AuthConfigError as e:
            raise ConfigError(str(e)) from None
        self.tokenizer_pool = ThreadPoolExecutor(2, thread_name_prefix="calid-tokenize")
        self._draining = False
        self.calls = WorkerCalls(self.cfg, draft, target, self._id,
                                 lambda: {"queued": float(len(self._waiting)), **self._rates.snapshot()})
        self.orch.replica_of = lambda rid: self.calls.replica_of("target", rid)  # the planner's cost per replica
        try:  # in a Serve replica the constructor runs on the event loop: calibrate now, before the first auto request
            self._calibration_task()
        except RuntimeError:  # built outside a running loop (in-process tests): the first auto step starts it
            pass

    # ---- what every front-end shares ------------------------------------------------------

    def health(self) -> dict:
        alive = not self._draining and (self._loop_task is None or not self._loop_task.done())
        return dict(serving=alive, active_requests=len(self.orch.active), queued_requests=len(self._waiting),
                    queue_capacity=self.cfg.queue_capacity)

    def modes(self) -> list[str]:
        return [m for m in MODES if self.draft is not None or m in ("ar", "lookahead", "auto")]

    async def stats(self) -> dict:
        """Router counters for tests and the demo (not part of the gRPC API)."""
        return {"active": len(self.orch.active), "waiting": len(self._waiting), "requests": len(self._requests),
                "steps": self._steps, "max_escalation_batch": self._max_escalation, "draining": self._draining,
                "pid": os.getpid(), "target_calls": self.calls.sent["target"], "draft_calls": self.calls.sent["draft"],
                "target_fanout": self.calls.fanout["target"], "step_s": self._step_s,
                "call_s": dict(self.calls.seconds), "draft_lost": self._draft_lost,
                "draft_available": self.orch.draft_available, "planned": dict(self.orch.planned),
                "call_overhead_ms": {k: round(1000 * v, 2) for k, v in self.call_overhead_s.items()},
                "costs_known": self.orch.verify_cost.known,  # the planner has forward costs (calibrated or live)
                "pages": pages(),  # this replica's malloc: huge pages or 4 KiB (calid.hugepages)
                "guard": {"overruled": self.orch.guard.overruled, "unplanned": self.orch.guard.unplanned,
                          "ms_per_token": self.orch.guard.summary()}
                if self.orch.guard is not None else {},
                "agreement": {"audited_tokens": self.orch.audited[1], "agreed_tokens": self.orch.audited[0],
                              "draft_top1_match": self.orch.agreement.agreement_rate,
                              "calibration": str(self.agreement_calibration or "")},
                "quality_table": self.quality[1] if self.quality else "",  # where max_quality_loss's table came from
                "model": self.model_id, "slo": {"met": self._slo[True], "missed": self._slo[False]},
                "admission": {"tokens_per_s": self._backlog.rate.per_s, "refused_late": self._refused_late}}

    async def worker_stats(self) -> dict:
        """Each worker role's own stats (one replica's: time in forwards, batches, caches), as this router reaches
        it: the benchmarks read forward time here in either topology. A role whose replica does not answer
        within STATS_TIMEOUT_S (one being replaced) is left out."""
        roles = {"target": self.target, "draft": self.draft}
        return await answered({role: handle.stats.remote() for role, handle in roles.items() if handle is not None},
                              STATS_TIMEOUT_S)

    async def drain(self, grace_s: float | None = None) -> dict:
        """Stop admitting: new calls get UNAVAILABLE (the SDK retries them elsewhere) and Health says not
        serving, while the requests in flight run to the end, or for at most ``grace_s`` (None: no bound): then
        they end UNAVAILABLE, so that Serve's graceful stop (which waits up to request_timeout_s, for the sake of
        in-place updates) does not wait for them. The caller polls stats() until none is left."""
        self._draining = True
        if grace_s is not None:
            asyncio.get_running_loop().call_later(grace_s, self._end_all)
        return await self.stats()

    def _end_all(self) -> None:
        for rid in list(self._requests):
            self._deliver_failure(rid, Failure(grpc.StatusCode.UNAVAILABLE,
                                               "the server stopped before this request finished; send it again"))

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return {"queue_depth": float(len(self._waiting)), "active": float(len(self.orch.active)),
                **self._rates.snapshot()}

    # ---- admission and delivery ------------------------------------------------------

    async def open(self, request: pb.GenerateRequest, caller: Caller, edge: bool = False) -> _Request:
        """The one request path: authenticate, check, tokenize (off the event loop) and admit; a refusal
        raises Refused. Everything that costs nothing runs before the tokenizer, so refusals take no time.
        ``edge``: a Collaborate request, drafted by the client."""
        return (await self.open_all([request], caller, edge))[0]

    async def open_all(self, requests: list[pb.GenerateRequest], caller: Caller,
                       edge: bool = False) -> list[_Request]:
        """``open`` for requests that belong together (an OpenAI call's prompts and their n choices): all are
        admitted, in one go, or none. Admitted together, they start in the same step, so a prompt's choices
        are prefilled once (calid.runtime.twins)."""
        rs = []
        try:
            for request in requests:
                rs.append(await self._check(request, caller, edge, len(rs)))
        except BaseException:
            for r in rs:  # never queued: nothing else holds them
                self._requests.pop(r.req.request_id, None)
            raise
        for r in rs:
            if not r.score_only:
                self._waiting.append(r.req.request_id)
        if len(rs) > sum(r.score_only for r in rs):
            self._ensure_loop()
            self._wake.set()
            if len(self.orch.active) < self.cfg.max_active:  # they can start with the next forward
                self._cut_runs()
        return rs

    async def _check(self, request: pb.GenerateRequest, caller: Caller, edge: bool, held: int) -> _Request:
        """Authenticate, check and tokenize one request, and register it (not queued yet); ``held``: requests
        of the same call checked before it, which count against the limits as if queued."""
        arrived = time.perf_counter()
        mode, frontend = request.mode or "default", caller.frontend
        self.authorize(caller, mode)
        if self._draining:
            raise self.refuse(mode, grpc.StatusCode.UNAVAILABLE,
                              "this server is shutting down and admits no new requests; retry", frontend)
        if request.model and request.model not in (self.model_id, self.cfg.target):
            raise self.refuse(mode, grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served here "
                              f"(served: {self.model_id})", frontend)
        if self._full(held):
            raise self._refuse_full(mode, frontend)
        try:
            protocol.check_limits(request, self.cfg.limits)
            req = await asyncio.get_running_loop().run_in_executor(
                self.tokenizer_pool, protocol.to_request, request, self.tokenizer, self.orch.default_decode,
                self.cfg.limits, self.quality, edge)
            self._n += 1
            req.request_id = f"{self._id}-{self._n}"
            self.orch.validate(req, edge=edge)
            if (request.HasField("logprobs") or request.echo) and edge:
                raise InvalidRequestError("logprobs and echo are not served for Collaborate requests")
            if max(req.prompt_ids) >= self.vocab_size:
                raise InvalidRequestError(f"prompt token ids must be below the vocabulary size {self.vocab_size}")
            if req.params.grammar is not None and self.cfg.sharded:
                raise InvalidRequestError("structured output and tool_choice required/named are not served by a "
                                          "sharded target (target_tp/target_pp > 1)")
        except UncalibratedError as e:
            raise self.refuse(mode, grpc.StatusCode.FAILED_PRECONDITION, str(e), frontend) from None
        except CalidError as e:
            raise self.refuse(mode, grpc.StatusCode.INVALID_ARGUMENT, str(e), frontend) from None
        if self._full(held):  # others were admitted while this one was tokenized
            raise self._refuse_full(req.decode.mode, frontend)
        self._refuse_late(req, held, frontend)
        r = _Request(request.request_id or req.request_id, req.decode.mode, req,
                     time.monotonic() + self.cfg.request_timeout_s,
                     owner=caller.key if self._keys is not None else None, edge=edge, arrived=arrived,
                     frontend=frontend, logprobs=request.logprobs if request.HasField("logprobs") else None,
                     echo=request.echo, score_only=protocol.score_only(request))
        self._requests[req.request_id] = r
        return r

    def _cut_runs(self) -> None:
        """A request arrived while the target runs a run of plain steps: have the run end after its current
        step, so that the new request starts with the next forward instead of waiting out the run."""
        for where in self._in_runs:
            self.target.cut_runs.remote(replica=where)  # fire and forget: a late cut only shortens the next run
        self._in_runs = set()

    def _full(self, held: int = 0) -> bool:
        # the bound holds whatever the step loop is doing: slots fill only between steps, so a burst
        # that arrives during a step must count against decoding slots and queue together
        queued = len(self._waiting) + len(self.orch.active) + held
        return queued >= self.cfg.max_active + self.cfg.queue_capacity

    def _refuse_full(self, mode: str, frontend: str) -> Refused:
        refused = self.refuse(mode, grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"admission queue is full ({self.cfg.queue_capacity} waiting beside "
                              f"{self.cfg.max_active} decoding); retry later", frontend)
        refused.retry_after_s = RETRY_AFTER_S
        return refused

    def _refuse_late(self, req: GenerationRequest, held: int, frontend: str) -> None:
        """Refuse ``req`` (RESOURCE_EXHAUSTED, with when to retry) if it would wait for a slot and the work
        admitted before it, with its own, would not be done within request_timeout_s (calid.admission)."""
        ahead = sum(self._budget_left(r.req) for r in self._requests.values() if not r.score_only)
        own = self._budget_left(req)
        must_wait = len(self._waiting) + len(self.orch.active) + held >= self.cfg.max_active
        verdict = self._backlog.judge(ahead, own, must_wait)
        if verdict.admit:
            return
        self._refused_late += 1
        refused = self.refuse(req.decode.mode, grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the requests ahead would keep this one from finishing within request_timeout_s="
                              f"{self.cfg.request_timeout_s:g} (about {verdict.finish_s:.0f} s of work at the "
                              f"measured {self._backlog.rate.per_s:.1f} tokens/s); retry in "
                              f"{verdict.retry_after_s:g} s", frontend)
        refused.retry_after_s = verdict.retry_after_s
        raise refused

    def _budget_left(self, req: GenerationRequest) -> int:
        s = self.orch.active.get(req.request_id)
        return budget_left(req.params.max_new_tokens, len(req.prompt_ids), len(s.output) if s else 0,
                           self.max_position)

    def authorize(self, caller: Caller, mode: str) -> None:
        if self._keys is not None and not allowed(self._keys, caller.key):
            raise self.refuse(mode, grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key: send "
                              "'authorization: Bearer <key>' (gRPC metadata or HTTP header)", caller.frontend)

    def refuse(self, mode: str, code: grpc.StatusCode, message: str, frontend: str = "grpc") -> Refused:
        """Count a refused (or failed) request and return the Refused to raise."""
        # a metric tag from a known set only: a client's mode string is unbounded and may not be ASCII
        self._metrics.failed(mode if mode in MODES or mode in ("default", "models", "cancel") else "invalid",
                             code.name, frontend if frontend in FRONTENDS else "grpc")
        return Refused(code, message)

    async def events(self, r: _Request, idle_s: float | None = None):
        """The request's events until it finishes or fails (an edge request's: until its round ends).
        ``idle_s``: yield IDLE whenever nothing happened for this long (a front-end's keep-alive)."""
        while True:
            left = max(0.0, r.deadline - time.monotonic())
            try:
                if left and not r.events.empty():  # a step's burst: no timer and task per event (wait_for's)
                    item = r.events.get_nowait()
                else:
                    item = await asyncio.wait_for(r.events.get(), timeout=left if idle_s is None else min(left, idle_s))
            except asyncio.TimeoutError:
                if idle_s is not None and r.deadline > time.monotonic():
                    yield IDLE
                    continue
                yield Failure(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"request did not finish within request_timeout_s={self.cfg.request_timeout_s:g}")
                return
            yield item
            if isinstance(item, (Failure, RoundEnd)) or item.result is not None:
                return

    def cancel(self, client_id: str, caller: Caller) -> bool:
        """Close the caller's requests named ``client_id`` (an API key sees only its own); False: none."""
        owner = caller.key if self._keys is not None else None
        found = [r for r in self._requests.values() if r.client_id == client_id and r.owner == owner]
        for r in found:
            self.close(r)
        return bool(found)

    def wake(self) -> None:
        """Something a step can use arrived outside the request path (an edge client's round): step now."""
        self._wake.set()

    def close(self, r: _Request) -> None:
        """The caller is done with ``r`` (finished, failed, or the client went away): free its state."""
        rid = r.req.request_id
        if r.score_only:  # never entered the step loop
            self._requests.pop(rid, None)
        elif rid in self._requests:
            self._cancelled.add(rid)
            self._wake.set()

    # ---- the step loop --------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            # a fresh context: the loop must not inherit (and be cancelled with) the request that started it
            self._loop_task = asyncio.get_running_loop().create_task(self._loop(), context=contextvars.Context())

    async def _loop(self) -> None:
        while True:
            self._drop_cancelled()
            self._admit()
            states = [s for s in self.orch.active.values() if self._ready(s)]
            self._metrics.queue_depth.set(len(self._waiting))
            self._metrics.active.set(len(self.orch.active))
            if not states:
                self._flush_held()
                self._wake.clear()
                await self._wake.wait()
                continue
            start, produced = time.perf_counter(), sum(len(s.output) for s in states)
            try:
                await self._step(states)
            except WorkersUnavailable as e:
                log.warning("calid router: failing %d requests: %s", len(states), e)
                for s in states:
                    self._deliver_failure(s.req.request_id, Failure(e.code, str(e)))
            except Exception as e:  # a bug must not take down every later request
                log.exception("calid router: step failed")
                for s in states:
                    self._deliver_failure(s.req.request_id, Failure(grpc.StatusCode.INTERNAL, f"internal error: {e!r}"))
            self._finish(self.orch.finished())
            elapsed = time.perf_counter() - start
            self._step_s += elapsed
            self._backlog.rate.add(sum(len(s.output) for s in states) - produced, elapsed)
            if self._inline:  # the next step's forwards hold the loop: arrivals and the streams go first
                await self._let_streams_take(states)

    async def _let_streams_take(self, states: list[RequestState]) -> None:
        """Turn the loop until the streams of ``states`` have taken this step's events (and requests that arrived
        meanwhile have come in): a reader takes an event through a few awaits (the queue's getter, events()'s
        wait_for, the front-end's generators), so the loop turns until every one of their queues is empty and then
        STREAM_TURNS_AFTER more times; STREAM_TURNS at most, for a reader that does not read."""
        queues = [r.events for s in states if (r := self._requests.get(s.req.request_id)) is not None]
        after = STREAM_TURNS_AFTER
        for _ in range(STREAM_TURNS):
            await asyncio.sleep(0)
            if all(q.empty() for q in queues):
                after -= 1
                if after < 0:
                    return

    def _ready(self, s: RequestState) -> bool:
        """Whether a step can advance ``s`` now: an edge request waits for its client's next round."""
        r = self._requests.get(s.req.request_id)
        return r is None or not r.edge or r.round is not None

    def _admit(self) -> None:
        while self._waiting and len(self.orch.active) < self.cfg.max_active:
            rid = self._waiting.popleft()
            if rid in self._requests:
                r = self._requests[rid]
                self.orch.start(r.req, arrived=r.arrived)

    def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        gone = []
        for rid in self._cancelled:
            self._requests.pop(rid, None)
            s = self.orch.finish(rid)
            if s is not None:
                gone.append(s)
        self._waiting = deque(rid for rid in self._waiting if rid not in self._cancelled)
        self._cancelled.clear()
        self.calls.release(gone)

    async def _step(self, states: list[RequestState]) -> None:
        """Drive one step (Orchestrator.step) with the workers' calls, an edge request's round as its draft."""
        self._steps += 1
        if any(s.req.decode.mode == "auto" for s in states):
            calibration = self._calibration_task()  # an auto plan needs the costs (started at start-up)
            if not calibration.done():
                await asyncio.shield(calibration)
        edge = [r for s in states if (r := self._requests.get(s.req.request_id)) is not None and r.edge]
        before = {r.req.request_id: (len(s.output), s.stats.draft_tokens)  # to tell when each edge round is used
                  for r in edge for s in [self.orch.active[r.req.request_id]]}
        step = self.orch.step(states, [self._edge_draft(r) for r in edge])
        verified = False
        io = advance(step)
        while io is not None:
            if isinstance(io, DraftCall):
                io = advance(step, await self._draft_step(io.tasks))
            elif isinstance(io, VerifyCall):
                verified = True
                io = advance(step, await self._verify_step(io.tasks, states, bool(edge)))
            else:
                if not verified:  # a step with no target call (filter's early acceptance) is not a plain one
                    self._run_left = 0
                self._deliver(io.events)
                io = advance(step)
        self._end_rounds(edge, before)
        self._count_tokens([s for s in states if s.req.request_id in self.orch.active])
        if self._steps % COST_EXPORT_STEPS == 1:
            self._metrics.costs(self.orch.verify_cost, self.orch.draft_cost, self.orch.replica_costs)

    async def _draft_step(self, tasks: list) -> list:
        if not tasks:
            return []
        drafts, failed = await self._draft(tasks)
        self._drop_failed(failed)
        for _, group, reply, seconds in self.calls.timed["draft"] if drafts else ():  # a draft step per replica
            if reply.results:
                self.orch.observe_draft(len(group), max(d.forwards for d in reply.results), seconds)
        return drafts

    async def _verify_step(self, verify: list, states: list[RequestState], edge: bool) -> list:
        if self._inline:  # one forward a call (an arrival could not cut a run holding the loop); a run streams
            self._count_run(1 if edge else self.orch.plain_run_room(verify, self.cfg.plain_run_ms / 1000))
        elif not edge and not self._waiting:  # a request waiting for a slot would wait out the run
            if self.orch.lengthen_plain_steps(verify, self.cfg.plain_run_ms / 1000) > 1:
                self._in_runs = {self.calls.replica_of("target", t.request_id) for t in verify}
        self._max_escalation = max(self._max_escalation, len(verify))
        self._metrics.escalation_batch.observe(len(verify))
        try:
            results, failed = await self.calls.call("target", verify)
        finally:
            self._in_runs = set()
        self._drop_failed(failed)
        if not failed and all(s.stats.target_calls for s in states if s.req.request_id in self.orch.active):
            # decode steps only: a prefill's size is unknown here
            for replica, group, reply, seconds in self.calls.timed["target"]:  # each replica's forward, on its own
                forwards = max((r.forwards for r in reply.results), default=1)  # a run of plain steps: per step
                lengths = [t.fed for t in group]
                self.orch.observe_verify(sum(lengths), seconds / forwards, replica, lengths)
        return results

    async def _draft(self, tasks: list) -> tuple[list, dict]:
        """The draft workers' results; when they cannot be reached (their node lost, replicas restarting), the
        step goes on without them: the target generates each of these requests' next token (orch.plain_step)
        and later steps stay plain until a background probe hears from a draft replica again."""
        try:
            return await self.calls.call("draft", tasks, retries=DRAFT_RETRIES)
        except WorkersUnavailable as e:
            if e.code != grpc.StatusCode.UNAVAILABLE:
                raise
            log.warning("calid router: draft unreachable (%s); decoding without it until a draft replica answers", e)
            self._metrics.draft_lost.inc()
            self._draft_lost += 1
            self._metrics.draft_available.set(0)
            self.orch.draft_available = False
            self.orch.plain_step([t.request_id for t in tasks])
            if self._draft_probe is None or self._draft_probe.done():
                self._draft_probe = asyncio.get_running_loop().create_task(self._probe_draft(),
                                                                           context=contextvars.Context())
            return [], {}

    async def _probe_draft(self) -> None:
        while not self.orch.draft_available:
            await asyncio.sleep(DRAFT_PROBE_S)
            try:
                await asyncio.wait_for(self.draft.whoami.remote(), self.cfg.worker_call_timeout_s)
            except Exception as e:  # still gone
                log.info("calid router: draft still unreachable: %r", e)
                continue
            log.warning("calid router: a draft replica answers again; drafting resumes")
            self._metrics.draft_available.set(1)
            self.orch.draft_available = True

    def _edge_draft(self, r: _Request):
        """The DraftResult of an edge request's round (calid.edge.round_draft)."""
        s = self.orch.active[r.req.request_id]
        return round_draft(r.req.request_id, r.round, mode=r.req.decode.mode, threshold=s.threshold,
                           vocab_size=self.vocab_size, sampled=not r.req.params.warp.greedy)

    def _end_rounds(self, edge: list[_Request], before: dict) -> None:
        """An edge round is used up once its request moved on (a target that only prefilled a chunk of the
        prompt leaves the round for the next step); its client then hears how many draft tokens were kept."""
        for r in edge:
            rid = r.req.request_id
            s = self.orch.active.get(rid)
            if s is None or rid not in self._requests:  # failed or cancelled during the step
                continue
            produced, drafted = before[rid]
            if len(s.output) > produced or s.finish_reason:
                r.round = None
                r.events.put_nowait(RoundEnd(s.stats.draft_tokens - drafted))

    def _drop_failed(self, failed: dict[str, Failure]) -> None:
        """Fail the requests a worker could not serve (they leave the orchestrator); the others go on."""
        for rid, failure in failed.items():
            self._deliver_failure(rid, failure)

    def _calibration_task(self) -> asyncio.Task:
        """The calibration (_calibrate), started on first use: a router starts it as it starts, in the background,
        so that the first auto request does not pay it (Qwen 1.5B with its draft, 2-core CPU: 10-19 s)."""
        if self._calibration is None:
            self._calibration = asyncio.get_running_loop().create_task(self._calibrate(),
                                                                       context=contextvars.Context())
        return self._calibration

    async def calibrated(self) -> dict[str, float]:
        """Wait for the calibration; a no-op call's round trip per worker role, in ms (empty: it failed, and auto
        requests decode plain). serve_app waits on this before it calls the app ready."""
        await asyncio.shield(self._calibration_task())
        return {k: round(1000 * v, 2) for k, v in self.call_overhead_s.items()}

    async def _calibrate(self) -> None:
        """The workers' measured forward costs, the auto mode planner's starting point (refined live). A worker
        times its forwards alone; live timings are whole calls (transport, dispatch), so each calibrated cost
        gets its role's measured round trip: otherwise the sizes timed live (a plain step) looked dearer than
        the sizes known from calibration only (a verification), and auto drafted where it lost (Qwen 1.5B,
        c=1 served: one token 36 ms live against two 57 ms calibrated, where two cost 2x one)."""
        try:
            verify = await self.target.costs.remote()
            draft = await self.draft.costs.remote() if self.draft is not None else {}
            verify_trip = await _round_trip_s(self.target)
            draft_trip = await _round_trip_s(self.draft) if self.draft is not None else 0.0
        except Exception:  # a worker that cannot calibrate leaves auto requests on plain decoding
            log.exception("calid router: calibration failed")
            return
        self.call_overhead_s = {"target": verify_trip, "draft": draft_trip}
        for size, secs in verify.items():
            self.orch.observe_verify(size, secs + verify_trip, lengths=[size])  # one sequence of that size
        self.orch.draft_prefill_s = draft.pop("prefill_s", 0.0)
        for size, secs in draft.items():
            self.orch.observe_draft(size, 1, secs + draft_trip)

    def _count_run(self, room: int) -> None:
        """Inline workers: where this step could start a run of ``room`` plain steps (Orchestrator.plain_run_room),
        the router runs them one forward at a time but holds their tokens until the run's last step, so they stream
        as one chunk, as a run's do in the split topology (a chunk costs the serving processes a message through
        Serve's proxy: on 2 cores, CPU taken from llama.cpp's threads). A step that is not plain ends the run."""
        if room < 2:
            self._run_left = 0
        elif self._run_left >= 2:
            self._run_left -= 1
        else:
            self._run_left = room

    def _deliver(self, events: list[StreamEvent]) -> None:
        if self._run_left >= 2 and all(e.result is None for e in events):
            self._held += events  # a run's tokens, for its last step (_count_run)
            return
        events, self._held = self._held + events, []
        for e in events:
            r = self._requests.get(e.request_id)
            if r is not None:
                r.events.put_nowait(e)
                if e.result is not None:
                    try:
                        self._metrics.finished(e.result, r.mode, r.frontend)
                        met = meets_slo(e.result, self.cfg.slo_ttft_ms, self.cfg.slo_tpot_ms)
                        self._metrics.attainment(met)
                        if met is not None:
                            self._slo[met] += 1
                    except Exception:  # metrics must never fail a request
                        log.exception("calid router: recording metrics failed")

    def _deliver_failure(self, rid: str, failure: Failure) -> None:
        self._flush_held()  # a stream's tokens before its failure
        r = self._requests.get(rid)
        if r is not None:
            r.events.put_nowait(failure)
        s = self.orch.finish(rid)
        if s is not None:
            self.calls.release([s])

    def _flush_held(self) -> None:
        """Deliver what a run holds now (the run ends)."""
        self._run_left = 0
        if self._held:
            self._deliver([])

    def _finish(self, done: list[RequestState]) -> None:
        for s in done:
            self._requests.pop(s.req.request_id, None)
        self.calls.release(done)

    def _count_tokens(self, states: list[RequestState]) -> None:
        """Add this step's new tokens to the rate window: one entry per step and kind, not per request."""
        new = {True: [0, 0], False: [0, 0]}  # uses the draft -> [draft tokens, target tokens]
        drafted = {"edge": 0, "cluster": 0}  # where this step's accepted draft tokens were drafted
        for s in states:
            r = self._requests.get(s.req.request_id)
            if r is None:
                continue
            counts = new[s.req.decode.uses_draft]
            counts[0] += s.stats.draft_tokens - r.seen[0]
            counts[1] += s.stats.target_tokens - r.seen[1]
            drafted["edge" if r.edge else "cluster"] += s.stats.draft_tokens - r.seen[0]
            r.seen = (s.stats.draft_tokens, s.stats.target_tokens)
        for uses_draft, (d, t) in new.items():
            if d or t:
                self._rates.add(d, t, uses_draft)
        for where, n in drafted.items():
            if n > 0:  # Counter.inc refuses 0
                self._metrics.drafted.inc(n, tags={"where": where})
        self._metrics.filtered_fraction.set(self._rates.snapshot()["filtered_fraction"])
        self._metrics.agreement(self.orch.audited, self.orch.agreement)


async def _round_trip_s(handle, calls: int = CALIBRATION_PINGS) -> float:
    """The median seconds of a few no-op calls to a worker deployment: transport and dispatch, no forward."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        await handle.whoami.remote()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
