"""The router's side of its calls to the worker deployments, and what a request's handler hears back.

``WorkerCalls`` sends one call per affinity group and role (draft or target), each bounded by
worker_call_timeout_s; retries lost replicas and timeouts with backoff, cancelling the calls still in
flight first; isolates the request behind an error the worker's code raised; and frees finished
requests' caches on every replica that may hold one (the release echo).
"""
from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Callable

import grpc
from ray.exceptions import RayActorError, RayTaskError

from actors.group import GroupFailed

log = logging.getLogger("ray.serve")
RETRY_CAP_S = 2.0
RELEASE_ECHO_S = 30.0  # released ids ride along on every worker call this long, to reach every replica
RELEASE_ECHO_MAX = 256


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


class WorkersUnavailable(Exception):
    def __init__(self, role: str, cause: BaseException):
        super().__init__(f"the {role} deployment could not serve: {cause!r}")
        self.code = grpc.StatusCode.UNAVAILABLE if _is_system_error(cause) else grpc.StatusCode.INTERNAL


def _is_system_error(e: BaseException) -> bool:
    """A lost replica, actor or shard group, or a call that timed out (retrying elsewhere can help), not an
    error raised by the worker's code for these tasks."""
    if isinstance(e, RayTaskError):
        return isinstance(getattr(e, "cause", None), (RayActorError, GroupFailed))
    return True


class WorkerCalls:
    """``load()`` is the router's load report (queue, token rates) that rides along on every call."""

    def __init__(self, cfg, draft, target, router_id: str, load: Callable[[], dict]):
        self.cfg, self.draft, self.target = cfg, draft, target
        self.router_id, self.load = router_id, load
        self._released: deque[tuple[float, str]] = deque()  # (when, request id), newest last

    def group(self, request_id: str) -> str:
        return f"g{zlib.crc32(request_id.encode()) % self.cfg.affinity_groups}"

    def report(self) -> dict:
        horizon = time.monotonic() - RELEASE_ECHO_S
        while self._released and (self._released[0][0] < horizon or len(self._released) > RELEASE_ECHO_MAX):
            self._released.popleft()
        return {"router": self.router_id, **self.load(), "released": [rid for _, rid in self._released]}

    async def call(self, role: str, tasks: list) -> tuple[list, dict[str, Failure]]:
        """One call per affinity group, concurrently, each bounded by worker_call_timeout_s; returns the
        results and the requests that failed for good.

        A lost replica or a timeout is retried with backoff (any replica recomputes from the token ids);
        after ``worker_call_retries`` the whole step fails with WorkersUnavailable. Every retry first
        cancels the calls still in flight, so an orphan never meets its retry in a worker's batch. An
        error the worker's code raised for these tasks is not retried: ``_isolate`` finds the requests
        it belongs to and fails only those.
        """
        handle, method = (self.draft, "draft") if role == "draft" else (self.target, "verify")
        groups: dict[str, list] = {}
        for t in tasks:
            groups.setdefault(self.group(t.request_id), []).append(t)
        report = self.report()
        for attempt in range(self.cfg.worker_call_retries + 1):
            calls = [getattr(handle.options(multiplexed_model_id=key), method).remote(group, report)
                     for key, group in groups.items()]
            try:
                outs = await asyncio.wait_for(asyncio.gather(*calls), self.cfg.worker_call_timeout_s)
                return [r for out in outs for r in out], {}
            except (Exception, asyncio.CancelledError) as e:
                _cancel(calls)
                if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
                    raise  # the router itself is shutting down
                if not _is_system_error(e):  # one request: it is the culprit; several: find it
                    if len(tasks) == 1:
                        return [], {tasks[0].request_id: _request_failure(role, e)}
                    return await self._isolate(role, handle, method, groups, report, e)
                if attempt == self.cfg.worker_call_retries:
                    raise WorkersUnavailable(role, e) from e
                log.warning("calid router: %s call failed (attempt %d): %r; retrying", role, attempt + 1, e)
                await asyncio.sleep(min(RETRY_CAP_S, 0.2 * 2**attempt))  # a restarting replica takes seconds

    async def _isolate(self, role: str, handle, method: str, groups: dict[str, list], report: dict,
                       error: BaseException) -> tuple[list, dict[str, Failure]]:
        """A deterministic error in a call of several requests: call each request alone, once, so that the
        request that causes it fails (INTERNAL, with the worker's message) and the others go on."""
        alone = [(t, getattr(handle.options(multiplexed_model_id=key), method).remote([t], report))
                 for key, group in groups.items() for t in group]
        log.warning("calid router: %s call raised %r; retrying its %d requests one by one", role, error, len(alone))
        outs = await asyncio.gather(*(asyncio.wait_for(c, self.cfg.worker_call_timeout_s) for _, c in alone),
                                    return_exceptions=True)
        results, failed = [], {}
        for (t, call), out in zip(alone, outs):
            if isinstance(out, BaseException):
                _cancel([call])
                failed[t.request_id] = _request_failure(role, out)
            else:
                results += out
        return results, failed

    def release(self, done: list) -> None:
        """Tell the workers to free the finished requests' caches (fire and forget): the replica of each
        request's group now, and every replica that serves a call in the next RELEASE_ECHO_S (the ids ride
        along in the call's report), since a retry may have left a copy on another replica. ``done``:
        RequestStates."""
        groups: dict[str, list] = {}
        now = time.monotonic()
        for s in done:
            groups.setdefault(self.group(s.req.request_id), []).append(s)
            self._released.append((now, s.req.request_id))
        for key, group in groups.items():
            ids = [s.req.request_id for s in group]
            self.target.options(multiplexed_model_id=key).release.remote(ids, {s.req.request_id: s.token_ids
                                                                               for s in group})
            if self.draft is not None:
                self.draft.options(multiplexed_model_id=key).release.remote(ids)


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
