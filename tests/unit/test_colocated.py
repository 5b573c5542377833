"""LocalHandle: a worker object in the router's process behind the call shape of a Serve handle."""
from __future__ import annotations

import asyncio

import pytest

from serve_app.workers.colocated import LocalHandle


class _Worker:
    def __init__(self):
        self.calls = []

    async def verify(self, tasks, report=None, replica=None):
        self.calls.append((tasks, report, replica))
        await asyncio.sleep(0)
        return [t * 2 for t in tasks]

    async def whoami(self):
        return "local-1"

    async def slow(self):
        await asyncio.sleep(10)

    async def broken(self):
        raise RuntimeError("no")

    def _private(self):
        return "hidden"


def test_a_call_runs_on_the_loop_with_the_same_arguments_as_through_serve():
    worker = _Worker()
    h = LocalHandle(worker)

    async def main():
        return await h.verify.remote([1, 2], {"router": "r"}, replica="local-1")

    assert asyncio.run(main()) == [2, 4]
    assert worker.calls == [([1, 2], {"router": "r"}, "local-1")]


def test_a_call_can_be_cancelled_like_a_serve_response():
    h = LocalHandle(_Worker())

    async def main():
        call = h.slow.remote()
        await asyncio.sleep(0)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(main())


def test_broadcast_answers_for_the_one_local_replica():
    h = LocalHandle(_Worker())
    assert asyncio.run(h.broadcast("whoami").results_async(return_exceptions=True)) == ["local-1"]
    out = asyncio.run(h.broadcast("broken").results_async(return_exceptions=True))
    assert len(out) == 1 and isinstance(out[0], RuntimeError)
    with pytest.raises(RuntimeError):
        asyncio.run(h.broadcast("broken").results_async())


def test_private_members_are_not_reachable():
    with pytest.raises(AttributeError):
        LocalHandle(_Worker())._private
