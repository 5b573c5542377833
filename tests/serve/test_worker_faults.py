"""Worker replicas in process (the real deployment classes on SmolLM2, without Serve's transport): releases
that reach every replica, idle caches freed, a hung forward failing the health check, and a request that
arrives twice in one batch running once."""
from __future__ import annotations

import asyncio
import threading

import pytest

from serve_helpers import StandIn

from calid.v1 import calid_pb2 as pb
from serve_app.cluster.config import AppConfig

pytestmark = [pytest.mark.model]

PROMPT = "List three colors of the rainbow."


def _replica(**overrides):
    from serve_app.workers.deployments import TargetDeployment

    return TargetDeployment.func_or_class(AppConfig.small(draft=None, **overrides).model_dump())


class _Scripted(StandIn):
    """Serve's handle over several in-process replicas: verify call n (from 1) goes to
    ``replicas[route(n)]``; a release reaches only the last replica."""

    def __init__(self, replicas, route=lambda n: 0):
        self.replicas, self.route, self.n = replicas, route, 0

    async def _verify(self, *args):
        self.n += 1
        return await self.replicas[self.route(self.n)].verify(*args)

    async def _release(self, *args):
        await self.replicas[-1].release(*args)

    async def _costs(self):
        return {}


@pytest.fixture(scope="module")
def replicas():
    return _replica(), _replica()


def test_a_release_reaches_a_replica_that_was_not_told(replicas):
    """Request 1 starts on replica a and moves to b after two calls (as after a retry elsewhere: b lacks the
    ids a delta builds on, says so, and gets them in full); its release goes to b. Replica a frees its copy
    when the next call reaches it, whoever sends it."""
    from serve_app.router.router import Router

    a, b = replicas
    moved = [True]

    async def run():
        handle = _Scripted([a, b], route=lambda n: 1 if moved[0] and n > 2 else 0)
        router = Router.func_or_class(AppConfig.small(draft=None).model_dump(), None, handle)
        first = await router.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=6), None)
        rid = f"{router._id}-1"
        await asyncio.sleep(0.05)  # the fire-and-forget release lands
        held_before = (a._runner.cached_length(rid), b._runner.cached_length(rid))
        moved[0] = False  # the next request's calls reach a
        await router.Generate(pb.GenerateRequest(prompt="Name a prime number.", max_new_tokens=6), None)
        return first, held_before, (a._runner.cached_length(rid), b._runner.cached_length(rid))

    first, before, after = asyncio.run(run())
    assert len(first.token_ids) == 6
    assert before[0] > 0 and before[1] == 0  # a was never told...
    assert after == (0, 0)  # ...until the next request's call carried the release


def test_caches_no_call_touched_for_cache_idle_s_are_freed(replicas):
    from serve_app.router.router import Router

    replica = _replica(cache_idle_s=0.5)

    async def run():
        class _Keep(_Scripted):  # never releases: a lost release
            async def _release(self, *args):
                pass

        router = Router.func_or_class(AppConfig.small(draft=None).model_dump(), None, _Keep([replica]))
        await router.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=4), None)
        held = replica._runner.cached_count()
        await asyncio.sleep(0.6)
        await router.Generate(pb.GenerateRequest(prompt="Name a prime number.", max_new_tokens=4), None)
        return held, replica._runner.cached_length(f"{router._id}-1")

    held, after = asyncio.run(run())
    assert held == 1 and after == 0


def test_a_hung_forward_fails_the_health_check():
    replica = _replica(worker_call_timeout_s=0.3)
    unblock = threading.Event()

    async def run():
        asyncio.get_running_loop().create_task(replica._run_batch(lambda tasks: unblock.wait(10) and [], [[]]))
        await replica.check_health()  # a forward that just started is fine
        await asyncio.sleep(0.5)
        try:
            await replica.check_health()
        except RuntimeError as e:
            return str(e)
        finally:
            unblock.set()
        return None

    message = asyncio.run(run())
    assert message is not None and "replica is hung" in message


def test_a_request_twice_in_one_batch_runs_once_as_its_newest_call_says(replicas):
    from calid.workers.messages import VerifyTask

    replica, seen = replicas[0], []

    def record(tasks):
        seen.append(list(tasks))
        return [type("R", (), {"request_id": t.request_id})() for t in tasks]

    old = VerifyTask("r", [1, 2, 3], 3, None, None, 0, [])
    new = VerifyTask("r", [1, 2, 3, 4], 3, None, None, 0, [])
    other = VerifyTask("s", [5], 1, None, None, 0, [])
    out = asyncio.run(replica._run_batch(record, [[old, other], [new]]))
    assert [[t.token_ids for t in batch] for batch in seen] == [[[1, 2, 3, 4], [5]]]
    assert [len(call) for call in out] == [2, 1]
