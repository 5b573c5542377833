"""Chaos on the real local Ray with real gRPC: replicas killed under load, a router killed mid-call, a
thousand cancelled streams, and API keys over the wire."""
from __future__ import annotations

import asyncio
import time

import psutil
import pytest
from serve_helpers import deploy, handle, wait_until

from calid.client import AsyncClient, Client, ResourceExhausted, Unauthenticated, Unavailable
from serve_app.cluster.config import AppConfig

pytestmark = [pytest.mark.ray, pytest.mark.model]

PROMPTS = [f"Write one sentence about the number {i}." for i in range(32)]


def _replicas(app: str, deployment: str):
    import ray
    from ray.util import list_named_actors

    names = [a["name"] for a in list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#")]
    return [ray.get_actor(n, namespace="serve") for n in names]


async def _streams(port: int, app: str, on_progress=None) -> list[list[int]]:
    async with AsyncClient(f"127.0.0.1:{port}", app=app, timeout=600) as c:
        got = [[] for _ in PROMPTS]

        async def one(i):
            async for chunk in c.stream(PROMPTS[i], max_new_tokens=24, ignore_eos=True):
                got[i] += chunk.token_ids
                if on_progress:
                    await on_progress(got)

        await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
        return got


def test_killing_the_draft_then_the_target_replica_under_32_streams_loses_nothing(serve_port):
    import ray

    app = "chaos"
    deploy(AppConfig.small(app_name=app, grpc_port=serve_port, dtype="fp32", max_active=32))
    want = asyncio.run(_streams(serve_port, app))
    killed = []

    async def chaos(got):
        done = sum(map(len, got))
        if not killed and all(got):  # every stream is decoding
            (draft,) = _replicas(app, "draft")
            ray.kill(draft, no_restart=True)
            killed.append(("draft", done))
        elif len(killed) == 1 and done >= killed[0][1] + 64:
            (target,) = _replicas(app, "target")
            ray.kill(target, no_restart=True)
            killed.append(("target", done))

    got = asyncio.run(_streams(serve_port, app, chaos))
    assert [k for k, _ in killed] == ["draft", "target"]
    assert got == want and all(len(ids) == 24 for ids in got)  # 32/32 complete, token for token


def test_a_killed_router_ends_its_calls_unavailable_and_the_sdks_retry_succeeds(serve_port):
    import ray

    app = "router-kill"
    deploy(AppConfig.small(app_name=app, grpc_port=serve_port, draft=None))
    with Client(f"127.0.0.1:{serve_port}", app=app, timeout=120, retries=0) as c:
        stream = c.stream(PROMPTS[0], max_new_tokens=200, ignore_eos=True)
        next(stream)
        (router,) = _replicas(app, "router")
        ray.kill(router, no_restart=True)
        start = time.monotonic()
        with pytest.raises(Unavailable):  # on the wire Serve says INTERNAL (actor died); the SDK knows
            for _ in stream:
                pass
        ended_s = time.monotonic() - start
    assert ended_s < 10
    with Client(f"127.0.0.1:{serve_port}", app=app, timeout=120, retries=8, backoff_s=0.5) as c:
        assert len(c.generate(PROMPTS[1], max_new_tokens=8, ignore_eos=True).token_ids) == 8


def test_a_thousand_cancelled_streams_leave_no_state_and_no_memory_growth(small_app):
    """Each stream asks for 600 tokens, far more than can be decoded before the check: the server is idle
    again within seconds only because the cancellations freed them."""
    app, port = small_app.app_name, small_app.grpc_port
    router_pid = handle(app, "router").stats.remote().result()["pid"]

    refused = []

    async def cancel_many(n: int):
        async with AsyncClient(f"127.0.0.1:{port}", app=app, timeout=300) as c:
            async def one(i):
                stream = c.stream(PROMPTS[i % 32], max_new_tokens=600, ignore_eos=True, mode="speculative")
                if i % 10 == 0:  # one in ten leaves after its first chunk (mid-decoding)...
                    try:
                        async for _ in stream:
                            break
                    except ResourceExhausted:  # or is refused at admission: the flood's steps are mostly prefills
                        refused.append(i)  # of requests cancelled next, which makes the measured rate low
                    await stream.aclose()
                else:  # ...the others at once: while queued, tokenized, admitted or prefilling
                    task = asyncio.ensure_future(stream.__anext__())
                    await asyncio.sleep(0.002 * (i % 20))
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    await stream.aclose()

            for wave in range(0, n, 100):
                await asyncio.gather(*(one(i) for i in range(wave, min(n, wave + 100))))

    def idle():
        router = handle(app, "router").stats.remote().result()
        workers = [handle(app, d).stats.remote().result()["cached"] for d in ("draft", "target")]
        return router["requests"] == 0 and router["active"] == 0 and workers == [0, 0]

    asyncio.run(cancel_many(100))  # warm-up: allocator pools, compiled paths
    assert wait_until(idle, timeout_s=20)
    before = psutil.Process(router_pid).memory_info().rss
    asyncio.run(cancel_many(1000))
    assert wait_until(idle, timeout_s=20)
    grown = psutil.Process(router_pid).memory_info().rss - before
    print(f"router RSS grew {grown / 2**20:.1f} MiB over 1000 cancels ({len(refused)} streams refused at admission)")
    assert grown < 32 * 2**20, f"router grew {grown / 2**20:.1f} MiB over 1000 cancels"
    with Client(f"127.0.0.1:{port}", app=app, timeout=300) as c:  # and it still serves
        assert len(c.generate(PROMPTS[0], max_new_tokens=8, ignore_eos=True).token_ids) == 8


def test_api_keys_over_grpc(serve_port, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k-live\n")
    app = "keyed"
    deploy(AppConfig.small(app_name=app, grpc_port=serve_port, draft=None, api_keys_file=str(keys)))
    address = f"127.0.0.1:{serve_port}"
    with Client(address, app=app, timeout=120) as c:
        with pytest.raises(Unauthenticated, match="Bearer <key>"):
            c.generate(PROMPTS[0], max_new_tokens=4)
        with pytest.raises(Unauthenticated):
            list(c.stream(PROMPTS[0], max_new_tokens=4))
        assert c.health().serving
    with Client(address, app=app, timeout=120, api_key="k-wrong") as c:
        with pytest.raises(Unauthenticated):
            c.list_models()
    with Client(address, app=app, timeout=120, api_key="k-live") as c:
        assert len(c.generate(PROMPTS[0], max_new_tokens=4, ignore_eos=True).token_ids) == 4
        assert c.list_models().models[0].role == "target"
