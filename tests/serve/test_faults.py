"""Faults: a worker that dies mid-request costs time, not data; no worker at all is UNAVAILABLE."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from serve_helpers import GrpcContext, deploy

from calid.client import Client
from calid.v1 import calid_pb2 as pb
from serve_app.cluster.config import AppConfig
from serve_app.ingress.frontdoor import Caller, Refused

pytestmark = [pytest.mark.ray, pytest.mark.model]

PROMPT = "Write a Python function that checks whether a number is prime."


def _replica_actors(app: str, deployment: str):
    import ray
    from ray.util import list_named_actors

    names = [a["name"] for a in list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#")]
    return [ray.get_actor(n, namespace="serve") for n in names]


def test_target_replica_killed_mid_stream_the_request_still_completes(serve_port):
    import ray
    from ray import serve

    from serve_app.router.router import STATS_TIMEOUT_S

    deploy(AppConfig.small(app_name="fault", grpc_port=serve_port, draft=None))
    with Client(f"127.0.0.1:{serve_port}", app="fault", timeout=300) as c:
        want = c.generate(PROMPT, max_new_tokens=40, ignore_eos=True).token_ids
        stream = c.stream(PROMPT, max_new_tokens=40, ignore_eos=True)
        got = list(next(stream).token_ids)
        (replica,) = _replica_actors("fault", "target")
        ray.kill(replica, no_restart=True)  # Serve notices and starts a fresh replica
        # a diagnostic call meanwhile answers in bounded time, with or without the target being replaced
        t0 = time.monotonic()
        serve.get_deployment_handle("router", "fault").worker_stats.remote().result(timeout_s=60)
        assert time.monotonic() - t0 < STATS_TIMEOUT_S + 10
        for chunk in stream:
            got += chunk.token_ids
    assert got == want  # the router's token ids survived; the new replica recomputed the cache
    (router,) = _replica_actors("fault", "router")
    deadline = time.monotonic() + 15
    while ray.get(router.get_num_ongoing_requests.remote()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.get(router.get_num_ongoing_requests.remote()) == 0  # nothing left open that a graceful stop waits on


class _DeadHandle:
    """Stands in for a deployment whose every replica is gone."""

    calls = 0

    def options(self, **kw):
        return self

    def __getattr__(self, method):
        outer = self

        class _Method:
            def remote(self, *a, **kw):
                if method == "release":
                    return None  # fire and forget
                async def fail():
                    outer.calls += 1
                    from ray.exceptions import RayActorError
                    raise RayActorError()
                return fail()
        return _Method()


def test_no_worker_answers_is_unavailable_after_retries(serve_port):
    from serve_app.router.router import Router

    dead = _DeadHandle()
    router = Router.func_or_class(AppConfig.small(draft=None, worker_call_retries=2).model_dump(), None, dead)
    ctx = GrpcContext()
    resp = asyncio.run(router.Generate(pb.GenerateRequest(prompt="hi", max_new_tokens=4), ctx))
    assert ctx.code == grpc.StatusCode.UNAVAILABLE and "target deployment could not serve" in ctx.message
    assert dead.calls == 3 and resp.text == ""
    assert not router.orch.active and not router._requests  # nothing left behind


def test_admission_holds_for_a_burst_that_arrives_between_steps(serve_port):
    """150 requests opened before the step loop runs once: exactly max_active + queue_capacity are admitted,
    the rest are refused with RESOURCE_EXHAUSTED at once (the bound used to be checked only with every
    decoding slot busy, which is never true before the loop fills them)."""
    from serve_app.router.router import Router

    async def burst():
        router = Router.func_or_class(AppConfig.small(draft=None, max_active=4, queue_capacity=6).model_dump(),
                                      None, _DeadHandle())
        opened = await asyncio.gather(*(router.open(pb.GenerateRequest(prompt="hi", max_new_tokens=4), Caller())
                                        for _ in range(150)), return_exceptions=True)
        admitted = [r for r in opened if not isinstance(r, Exception)]
        refused = [e for e in opened if isinstance(e, Refused) and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
        for r in admitted:
            router.close(r)
        router._loop_task.cancel()
        return len(admitted), len(refused), refused[0].message

    admitted, refused, message = asyncio.run(burst())
    assert (admitted, refused) == (10, 140)
    assert "admission queue is full (6 waiting beside 4 decoding)" in message


def test_a_target_group_with_no_room_fails_each_call_in_bounded_time_and_keeps_its_reservation(serve_port):
    """A TP x PP group whose stages cannot be placed (a node type that is not up) fails each call with
    GroupFailed after build_wait_s, not after a forward's timeout, and keeps its placement groups pending
    so that room, when it appears, goes to it; shutdown frees them."""
    import time

    from ray.util.placement_group import placement_group_table

    from actors.group import GroupFailed, TargetGroup

    group = TargetGroup("smollm2-135m-instruct", tp=1, pp=2, resources={"no_such_node_type": 1},
                        ready_timeout_s=1.0, build_wait_s=0.5)
    with pytest.raises(GroupFailed, match="waits for room"):
        group.start()
    held = [pg.id for pg in group.pgs]
    assert len(held) == 2
    t0 = time.monotonic()
    with pytest.raises(GroupFailed, match="waits for room"):
        group.cached()
    assert time.monotonic() - t0 < 5
    assert [pg.id for pg in group.pgs] == held and group.shards == []
    assert {placement_group_table(pg)["state"] for pg in group.pgs} == {"PENDING"}
    group.shutdown()
    assert group.pgs == []
    assert {placement_group_table().get(pg.hex(), {}).get("state") for pg in held} <= {"REMOVED", None}
