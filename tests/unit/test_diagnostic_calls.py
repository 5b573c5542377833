"""A router's diagnostic calls to its workers (worker_stats) never wait on a replica being replaced: what does
not answer in time is left out and cancelled, so that no such call stays an ongoing request of the router."""
from __future__ import annotations

import asyncio

import pytest

from serve_app.router.calls import answered


class _Response:
    """Awaitable like a Serve DeploymentResponse: answers after ``delay_s`` (None: never), and can be cancelled."""

    def __init__(self, value, delay_s: float | None):
        self.value, self.delay_s, self.cancelled = value, delay_s, False

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self):
        if self.delay_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay_s)
        if isinstance(self.value, Exception):
            raise self.value
        return self.value

    def cancel(self):
        self.cancelled = True


def test_a_worker_that_does_not_answer_in_time_is_left_out_and_its_call_cancelled():
    target, draft = _Response({"cached": 3}, 0.01), _Response({"cached": 1}, None)  # the draft is being replaced
    got = asyncio.run(answered({"target": target, "draft": draft}, timeout_s=0.2))
    assert got == {"target": {"cached": 3}}
    assert draft.cancelled and not target.cancelled


def test_a_replica_that_died_under_the_call_is_left_out():
    from ray.exceptions import ActorUnavailableError

    died = _Response(ActorUnavailableError("the replica was killed", None), 0.0)
    got = asyncio.run(answered({"target": died, "draft": _Response({"cached": 1}, 0.0)}, timeout_s=1.0))
    assert got == {"draft": {"cached": 1}}


def test_a_failing_worker_is_an_error_and_no_workers_is_nothing():
    with pytest.raises(RuntimeError, match="replica died"):
        asyncio.run(answered({"target": _Response(RuntimeError("replica died"), 0.0)}, timeout_s=1.0))
    assert asyncio.run(answered({}, timeout_s=1.0)) == {}
