"""The engine topology's workers inline (serve_app.workers.colocated.colocated_workers): the router's calls run
a real SmolLM2 target's forwards on the router's own event loop, in the calling task, and the step loop lets each
step's events out before the next forward holds the loop.

What is real: the router, its step loop, the target deployment's class and its model. What is left out: Serve's
transport (the router is built in process and its stream read directly).
"""
from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from serve_helpers import GrpcContext

from calid.v1 import calid_pb2 as pb
from serve_app.cluster.config import AppConfig

pytestmark = [pytest.mark.model]


@pytest.fixture(scope="module")
def cfg():
    return AppConfig.small(draft=None, topology="engine").model_dump()


@pytest.fixture(scope="module")
def target(cfg):
    from serve_app.workers.colocated import colocated_workers

    draft, target = colocated_workers(cfg)
    assert draft is None
    return target


def test_each_forward_runs_on_the_loop_thread_after_the_last_steps_tokens_went_out(cfg, target):
    """Every forward runs on the thread of the loop that serves the stream, inside the router's own step task,
    and at each decode forward's start the stream has already taken every token of the steps before it (no
    step's tokens wait for the next forward to end)."""
    from serve_app.router.router import Router

    worker = target.worker.worker  # the deployment's TargetWorker
    verify = worker.verify
    seen: list[int] = []  # tokens the stream has taken
    at_forward: list[tuple[int, int, asyncio.Task | None]] = []  # (tokens seen, thread, task) as each forward starts

    def watched(tasks):
        at_forward.append((len(seen), threading.get_ident(), asyncio.current_task()))
        return verify(tasks)

    async def main():
        router = Router.func_or_class(cfg, None, target)
        await router.calibrated()
        worker.verify = watched
        try:
            request = pb.GenerateRequest(prompt="List three colors of the rainbow.", max_new_tokens=12,
                                         ignore_eos=True, mode="ar")
            async for chunk in router.GenerateStream(request, GrpcContext()):
                seen.extend(chunk.token_ids)
        finally:
            worker.verify = verify
        return threading.get_ident(), router._loop_task

    loop_thread, step_task = asyncio.run(main())
    assert len(seen) == 12
    assert len(at_forward) == 12  # one forward a token: no runs of plain steps when a call costs no round trip
    assert {thread for _, thread, _ in at_forward} == {loop_thread}
    assert {task for _, _, task in at_forward} == {step_task}
    assert [n for n, _, _ in at_forward] == list(range(12))  # forward k starts once tokens 1..k are out


def test_a_worker_call_goes_through_no_task_of_its_own(target):
    """WorkerCalls awaits an in-process worker's coroutine in the caller's task; an error the worker's code
    raises for one request fails that request only (INTERNAL, the worker's message), at once: the others of
    its call are retried alone and answered, as with a remote worker's error (no retries of the whole step)."""
    from serve_app.router.calls import WorkerCalls

    cfg = AppConfig.small(draft=None, topology="engine", worker_call_retries=0)
    calls = WorkerCalls(cfg, None, target, "r1", lambda: {"queued": 0.0, "target_demand": 0.0})
    worker = target.worker.worker
    verify = worker.verify
    tasks_seen = []

    def poisoned(tasks):
        tasks_seen.append(asyncio.current_task())
        if any(t.request_id == "bad" for t in tasks):
            raise ValueError("token 7 broke the kernel")
        return verify(tasks)

    async def main():
        worker.verify = poisoned
        try:
            first = await calls.call("target", [_a_verify_task("good")])
            return asyncio.current_task(), first, await calls.call("target", [_a_verify_task(r) for r in ("ok", "bad")])
        finally:
            worker.verify = verify

    caller, first, (results, failed) = asyncio.run(main())
    assert tasks_seen[0] is caller and [r.request_id for r in first[0]] == ["good"] and not first[1]
    assert [r.request_id for r in results] == ["ok"] and list(failed) == ["bad"]
    assert failed["bad"].code == grpc.StatusCode.INTERNAL and "token 7 broke the kernel" in failed["bad"].message


def _a_verify_task(request_id: str):
    from calid.decoding.modes import DecodeParams
    from calid.decoding.sampling import Warp
    from calid.workers.messages import VerifyTask

    return VerifyTask(request_id, [1, 2, 3], 3, DecodeParams(mode="ar"), Warp(), 0, [])
