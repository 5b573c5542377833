"""The router's side of its calls to the worker deployments, and what a request's handler hears back.

``WorkerCalls`` sends, per step and role (draft or target), at most one call to each worker replica that
holds some of the step's requests: a request is pinned to the replica that first served it (its KV cache
lives there), and a new request goes to the live replica with the fewest of this router's requests
(serve_app.router.replica_routing steers a call to the replica it names; the router learns the live replicas by
broadcast). Token ids travel as a delta against what that replica acknowledged holding; a replica that
lacks them says so and gets the full ids at once. Each call is bounded by worker_call_timeout_s; lost
replicas and timeouts are retried with backoff, cancelling the calls still in flight first; an error the
worker's code raised is isolated to its request; finished requests' caches are freed on every replica that
may hold one (the release echo).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Callable

import grpc
from ray.exceptions import RayActorError, RayTaskError

from actors.group import GroupFailed

log = logging.getLogger("ray.serve")
RETRY_CAP_S = 2.0
RELEASE_ECHO_S = 30.0  # released ids ride along on every worker call this long, to reach every replica
RELEASE_ECHO_MAX = 256
REPLICAS_REFRESH_S = 2.0  # how often the router asks which worker replicas are running


class RequestRefused(Exception):
    """Ends a stream with the status code already set on the gRPC context."""


@dataclass
class Failure:
    """A request ends with this status (delivered on its event queue)."""

    code: grpc.StatusCode
    message: str


@dataclass
class RoundEnd:
    """An edge request's round is done: ``accepted`` of its draft tokens were kept."""

    accepted: int


@dataclass
class Reply:
    """A worker call's answer: who served it, the results, and the requests whose token-id delta it could
    not apply (it does not hold their earlier ids; the caller resends them in full)."""

    replica: str | None  # None: a replica that takes no deltas (an in-process stand-in)
    results: list
    missing: list = field(default_factory=list)


class WorkersUnavailable(Exception):
    def __init__(self, role: str, cause: BaseException):
        super().__init__(f"the {role} deployment could not serve: {cause!r}")
        self.code = grpc.StatusCode.UNAVAILABLE if _is_system_error(cause) else grpc.StatusCode.INTERNAL


class InProcessWorkerError(Exception):
    """An error the code of a worker in the router's process raised (as RayTaskError is a remote one's)."""

    def __init__(self, cause: Exception):
        super().__init__(repr(cause))
        self.cause = cause


def in_process(handle) -> bool:
    """Whether ``handle`` stands for a worker in this process (serve_app.workers.colocated.LocalHandle)."""
    return getattr(handle, "in_process", False) is True


async def _worker_code(call):
    try:
        return await call
    except Exception as e:
        raise InProcessWorkerError(e) from e


def _is_system_error(e: BaseException) -> bool:
    """A lost replica, actor or shard group, or a call that timed out (retrying elsewhere can help), not an
    error raised by the worker's code for these tasks."""
    if isinstance(e, InProcessWorkerError):
        return False
    if isinstance(e, RayTaskError):
        return isinstance(getattr(e, "cause", None), (RayActorError, GroupFailed))
    return True


def expand_ids(task, held: list[int] | None):
    """``task`` with its full token ids, given the ids its replica ``held`` for it (None: nothing); None when
    the task is a delta whose head the replica does not hold."""
    start = task.ids_from
    if start == 0:
        return task
    if held is None or len(held) < start:
        return None
    return replace(task, token_ids=held[:start] + task.token_ids, ids_from=0)


def expand_all(tasks: list, held: dict) -> tuple[list, list]:
    """A replica's side of a call: the tasks with full token ids (``held``: request id -> the ids it holds)
    and the ids of the requests whose delta it cannot expand (the router resends those in full)."""
    full, missing = [], []
    for t in tasks:
        expanded = expand_ids(t, held.get(t.request_id))
        if expanded is None:
            missing.append(t.request_id)
        else:
            full.append(expanded)
    return full, missing


class WorkerCalls:
    """``load()`` is the router's load report (queue, token rates) that rides along on every call."""

    def __init__(self, cfg, draft, target, router_id: str, load: Callable[[], dict]):
        self.cfg, self.draft, self.target = cfg, draft, target
        self.router_id, self.load = router_id, load
        self._released: deque[tuple[float, str]] = deque()  # (when, request id), newest last
        self._live: dict[str, list[str]] = {"draft": [], "target": []}  # running replicas, by role
        self._live_at: dict[str, float] = {"draft": -1e9, "target": -1e9}
        self._pins: dict[str, dict[str, str]] = {"draft": {}, "target": {}}  # request -> replica holding its cache
        self._held: dict[str, dict[str, int]] = {"draft": {}, "target": {}}  # request -> ids its replica acknowledged
        self.sent = Counter()  # calls sent, by role
        self.fanout = Counter()  # the most replicas one step's calls of a role went to (at most the replicas)
        self.seconds = Counter()  # time spent waiting for calls, by role
        self.timed: dict[str, list[tuple[str | None, list, Reply, float]]] = {"draft": [], "target": []}

    def report(self, echo: bool = True) -> dict:
        """This router's load and (``echo``) the requests it released in the last RELEASE_ECHO_S."""
        horizon = time.monotonic() - RELEASE_ECHO_S
        while self._released and (self._released[0][0] < horizon or len(self._released) > RELEASE_ECHO_MAX):
            self._released.popleft()
        return {"router": self.router_id, **self.load(), "released": [rid for _, rid in self._released] if echo else []}

    def _handle(self, role: str):
        return (self.draft, "draft") if role == "draft" else (self.target, "verify")

    # ---- placement -------------------------------------------------------------------

    def _refresh_live(self, role: str) -> None:
        """Learn the running replicas of ``role`` in the background, every REPLICAS_REFRESH_S."""
        now = time.monotonic()
        if now - self._live_at[role] < REPLICAS_REFRESH_S:
            return
        self._live_at[role] = now
        asyncio.get_running_loop().create_task(self._ask_live(role))

    async def _ask_live(self, role: str) -> None:
        handle, _ = self._handle(role)
        try:
            ids = await asyncio.wait_for(handle.broadcast("whoami").results_async(return_exceptions=True),
                                         self.cfg.worker_call_timeout_s)
        except Exception:  # no broadcast (an in-process stand-in) or no answer: keep what we knew
            return
        live = sorted(r for r in ids if isinstance(r, str))
        if live:
            self._live[role] = live

    def _place(self, role: str, tasks: list) -> dict[str | None, list]:
        """Tasks by the replica to send them to: a request's pinned replica while it is running, else the
        running replica with the fewest of this router's requests; None (Serve picks) before any is known."""
        live, pins = self._live[role], self._pins[role]
        alive = set(live)
        load = Counter(pins.values())
        out: dict[str | None, list] = {}
        for t in tasks:
            rid = t.request_id
            where = pins.get(rid)
            if where is None or (alive and where not in alive):
                if where is not None:
                    load[where] -= 1
                where = min(live, key=lambda r: (load[r], r)) if live else None
                if where is not None:
                    pins[rid] = where
                    load[where] += 1
            out.setdefault(where, []).append(t)
        return out

    def _delta(self, role: str, t, where: str | None):
        """``t`` carrying only the ids its replica does not hold (by what that replica acknowledged)."""
        held = self._held[role].get(t.request_id)
        if where is None or held is None or held[0] != where or not 0 < held[1] <= len(t.token_ids):
            return t
        return replace(t, token_ids=t.token_ids[held[1]:], ids_from=held[1])

    # ---- calls -----------------------------------------------------------------------

    async def call(self, role: str, tasks: list, retries: int | None = None) -> tuple[list, dict[str, Failure]]:
        """One call per replica, concurrently, each bounded by worker_call_timeout_s; returns the results
        and the requests that failed for good.

        A lost replica or a timeout is retried with backoff (any replica recomputes from the token ids);
        after ``retries`` (default worker_call_retries) the whole step fails with WorkersUnavailable. Every retry first
        cancels the calls still in flight, so an orphan never meets its retry in a worker's batch. An
        error the worker's code raised for these tasks is not retried: ``_isolate`` finds the requests
        it belongs to and fails only those.
        """
        start = time.perf_counter()
        try:
            return await self._call(role, tasks, self.cfg.worker_call_retries if retries is None else retries)
        finally:
            self.seconds[role] += time.perf_counter() - start

    async def _call(self, role: str, tasks: list, retries: int) -> tuple[list, dict[str, Failure]]:
        handle, method = self._handle(role)
        self._refresh_live(role)
        local = in_process(handle)  # the only replica of its role, in this process: its tasks' ids are not copied
        # and its releases reach it directly, so full ids cost nothing to send and no release needs an echo
        report = self.report(echo=not local)
        for attempt in range(retries + 1):
            placed = self._place(role, tasks)
            self.fanout[role] = max(self.fanout[role], len(placed))
            timed = self.timed[role] = []
            sends = [(where, group, group if local else [self._delta(role, t, where) for t in group])
                     for where, group in placed.items()]
            calls = []
            try:
                if local:  # workers in this process (engine topology): awaited in turn, in this task
                    replies = [await _timed(self._send(role, handle, method, where, sent, report), group, timed)
                               for where, group, sent in sends]
                else:
                    calls = [self._send(role, handle, method, where, sent, report) for where, _, sent in sends]
                    replies = await asyncio.wait_for(asyncio.gather(*(_timed(c, group, timed) for c, (_, group, _)
                                                                      in zip(calls, sends))),
                                                     self.cfg.worker_call_timeout_s)
                resend = self._settle(role, placed, replies)
                if resend:  # replicas that lacked a delta's head: the full ids, once more
                    timed.clear()  # those replicas' times cover only part of the step's work
                    calls = [self._send(role, handle, method, where, group, report) for where, group in resend.items()]
                    more = await asyncio.wait_for(asyncio.gather(*calls), self.cfg.worker_call_timeout_s)
                    self._settle(role, resend, more)
                    replies += more
                return [r for reply in replies for r in reply.results], {}
            except (Exception, asyncio.CancelledError) as e:
                _cancel(calls)
                if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
                    raise  # the router itself is shutting down
                self._forget(role, [t.request_id for t in tasks])  # the next try sends full ids wherever it goes
                if not _is_system_error(e):  # one request: it is the culprit; several: find it
                    if len(tasks) == 1:
                        return [], {tasks[0].request_id: _request_failure(role, e)}
                    return await self._isolate(role, handle, method, tasks, report, e)
                if attempt == retries:
                    raise WorkersUnavailable(role, e) from e
                log.warning("calid router: %s call failed (attempt %d): %r; retrying", role, attempt + 1, e)
                self._live_at[role] = -1e9  # a replica may be gone: ask again
                self._refresh_live(role)
                await asyncio.sleep(min(RETRY_CAP_S, 0.2 * 2**attempt))  # a restarting replica takes seconds

    def _send(self, role: str, handle, method: str, where: str | None, tasks: list, report: dict):
        """The call, awaitable: a Serve response, or for a worker in this process (LocalHandle) its coroutine,
        run in the awaiting task (no timeout bounds it: its forwards hold the event loop a timeout would need)."""
        self.sent[role] += 1
        if in_process(handle):
            return _worker_code(handle.direct(method)(tasks, report, replica=where))
        return getattr(handle, method).remote(tasks, report, replica=where)

    def _settle(self, role: str, placed: dict, replies: list[Reply]) -> dict[str, list]:
        """Record where each request now lives and what that replica holds; the tasks to resend in full."""
        pins, held = self._pins[role], self._held[role]
        resend: dict[str, list] = {}
        for group, reply in zip(placed.values(), replies):
            missing = set(reply.missing)
            for t in group:
                pins[t.request_id] = reply.replica
                if t.request_id in missing:
                    held.pop(t.request_id, None)
                    resend.setdefault(reply.replica, []).append(t)
                else:
                    held[t.request_id] = (reply.replica, len(t.token_ids))
        return resend

    def replica_of(self, role: str, request_id: str) -> str | None:
        """The replica of ``role`` that holds ``request_id`` (None: not placed yet)."""
        return self._pins[role].get(request_id)

    def _forget(self, role: str, request_ids) -> None:
        for rid in request_ids:
            self._held[role].pop(rid, None)

    async def _isolate(self, role: str, handle, method: str, tasks: list, report: dict,
                       error: BaseException) -> tuple[list, dict[str, Failure]]:
        """A deterministic error in a call of several requests: call each request alone, once (full ids, on
        its replica), so that the request that causes it fails (INTERNAL, with the worker's message) and the
        others go on."""
        pins = self._pins[role]
        alone = [(t, self._send(role, handle, method, pins.get(t.request_id), [t], report)) for t in tasks]
        log.warning("calid router: %s call raised %r; retrying its %d requests one by one", role, error, len(alone))
        outs = await asyncio.gather(*(asyncio.wait_for(c, self.cfg.worker_call_timeout_s) for _, c in alone),
                                    return_exceptions=True)
        results, failed = [], {}
        for (t, call), out in zip(alone, outs):
            if isinstance(out, BaseException):
                _cancel([call])
                failed[t.request_id] = _request_failure(role, out)
            else:
                self._settle(role, {None: [t]}, [out])
                results += out.results
        return results, failed

    def release(self, done: list) -> None:
        """Tell the workers to free the finished requests' caches (fire and forget): the replica each
        request is pinned to now, and every replica that serves a call in the next RELEASE_ECHO_S (the ids
        ride along in the call's report), since a retry may have left a copy on another replica. ``done``:
        RequestStates."""
        now = time.monotonic()
        for role, handle in (("target", self.target), ("draft", self.draft)):
            if handle is None:
                continue
            by_replica: dict[str | None, list] = {}
            for s in done:
                by_replica.setdefault(self._pins[role].pop(s.req.request_id, None), []).append(s)
            self._forget(role, [s.req.request_id for s in done])
            for where, group in by_replica.items():
                ids = [s.req.request_id for s in group]
                if role == "target":
                    handle.release.remote(ids, {s.req.request_id: s.token_ids for s in group}, replica=where)
                else:
                    handle.release.remote(ids, replica=where)
        self._released.extend((now, s.req.request_id) for s in done)


async def _timed(call, tasks: list, into: list):
    """Await one replica's call and note (replica, its tasks, its reply, seconds): the per-replica cost model."""
    start = time.perf_counter()
    reply = await call
    into.append((reply.replica, tasks, reply, time.perf_counter() - start))
    return reply


def _cancel(calls: list) -> None:
    for c in calls:
        try:
            c.cancel()
        except Exception:  # already finished, or not a Serve response (tests)
            pass


def _request_failure(role: str, e: BaseException) -> Failure:
    """One request's failure: INTERNAL with the worker's own message for an error its code raised,
    UNAVAILABLE for a lost replica or a timeout."""
    cause = getattr(e, "cause", None) or e
    text = str(cause).strip().splitlines()
    code = grpc.StatusCode.UNAVAILABLE if _is_system_error(e) else grpc.StatusCode.INTERNAL
    return Failure(code, f"the {role} deployment failed on this request: {type(cause).__name__}: "
                         f"{text[-1] if text else ''}")


async def answered(calls: dict, timeout_s: float) -> dict:
    """The results of those ``calls`` (Serve responses, by key) that answer within ``timeout_s``; a failure is
    raised, except a replica's death (RayActorError: Serve had routed the call to a replica just killed), which
    is left out like a late answer. The others are cancelled: a replica being replaced answers nothing until
    its successor is up, and a call left waiting for it stays an ongoing request of the caller's replica, which
    Serve's graceful stop then waits for (the soak's router counted two such calls at its end)."""
    tasks = {key: asyncio.ensure_future(call) for key, call in calls.items()}
    done, pending = await asyncio.wait(tasks.values(), timeout=timeout_s) if tasks else (set(), set())
    for key, task in tasks.items():
        if task in pending:
            task.cancel()
            calls[key].cancel()  # cancelling the wait alone leaves the request itself in flight
    return {key: task.result() for key, task in tasks.items()
            if task in done and not isinstance(task.exception(), RayActorError)}
