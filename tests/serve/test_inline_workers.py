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


def _watch(target):
    """Record, as each target forward starts: the tokens the streams have taken so far (``seen``, which the test
    fills), the thread, the task and the requests of the forward. Returns (seen, log, undo)."""
    worker = target.worker.worker  # the deployment's TargetWorker
    verify = worker.verify
    seen: list[int] = []
    log: list[tuple[int, int, asyncio.Task | None, set]] = []

    def watched(tasks):
        log.append((len(seen), threading.get_ident(), asyncio.current_task(), {t.request_id for t in tasks}))
        return verify(tasks)

    worker.verify = watched
    return seen, log, lambda: setattr(worker, "verify", verify)


def _request(prompt: str, tokens: int):
    return pb.GenerateRequest(prompt=prompt, max_new_tokens=tokens, ignore_eos=True, mode="ar")


def test_each_forward_runs_on_the_loop_thread_after_the_last_steps_tokens_went_out(cfg, target):
    """Without runs of plain steps (plain_run_ms 0), every forward runs on the thread of the loop that serves the
    stream, inside the router's own step task, and at each decode forward's start the stream has already taken
    every token of the steps before it (no step's tokens wait for the next forward to end)."""
    from serve_app.router.router import Router

    async def main():
        router = Router.func_or_class({**cfg, "plain_run_ms": 0.0}, None, target)
        await router.calibrated()
        seen, log, undo = _watch(target)
        try:
            async for chunk in router.GenerateStream(_request("List three colors of the rainbow.", 12),
                                                     GrpcContext()):
                seen.extend(chunk.token_ids)
        finally:
            undo()
        return threading.get_ident(), router._loop_task, seen, log

    loop_thread, step_task, seen, log = asyncio.run(main())
    assert len(seen) == 12 and len(log) == 12  # one forward a token
    assert {thread for _, thread, _, _ in log} == {loop_thread}
    assert {task for _, _, task, _ in log} == {step_task}
    assert [n for n, _, _, _ in log] == list(range(12))  # forward k starts once tokens 1..k are out


def test_a_run_of_plain_steps_streams_as_one_chunk_and_an_arrival_joins_the_next_forward(cfg, target):
    """With runs (plain_run_ms, the default), the router still runs one forward a call but holds a run's tokens
    for its last step: the stream gets them in chunks of several tokens, the same tokens as without runs. A
    request that arrives during a run starts with the next forward, not after the run."""
    from serve_app.router.router import Router

    async def main():
        router = Router.func_or_class(cfg, None, target)
        await router.calibrated()
        seen, log, undo = _watch(target)
        chunks, arrived_at = [], []
        try:
            async def second():
                arrived_at.append(len(log))
                return [t async for c in router.GenerateStream(_request("Name a prime number.", 4), GrpcContext())
                        for t in c.token_ids]

            async for chunk in router.GenerateStream(_request("List three colors of the rainbow.", 24),
                                                     GrpcContext()):
                chunks.append(list(chunk.token_ids))
                seen.extend(chunk.token_ids)
                if len(chunks) == 2:  # the first run's tokens are out; the next run has started or starts now
                    other = asyncio.ensure_future(second())
            second_tokens = await other
        finally:
            undo()
        return chunks, log, arrived_at[0], second_tokens

    chunks, log, arrived_at, second_tokens = asyncio.run(main())
    tokens = [t for c in chunks for t in c]
    assert len(tokens) == 24 and len(second_tokens) == 4
    assert max(map(len, chunks)) > 1 and len(chunks) < 24  # a run's tokens together
    alone = [i for i, (_, _, _, ids) in enumerate(log) if len(ids) == 1]
    assert len(alone) + sum(len(ids) == 2 for _, _, _, ids in log) == len(log)
    joined = next(i for i, (_, _, _, ids) in enumerate(log) if len(ids) == 2)
    assert joined <= arrived_at + 1  # admitted at the step after it arrived


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
