"""The router against worker faults it must contain, in process: a real SmolLM2 target worker behind a
stand-in for Serve's handle that can raise for one request, hang a call, or count what it was sent.

What is real: the router, its step loop, the orchestrator, the target model and its verification.
What is stood in for: Serve's transport (the handle), so that a fault lands exactly where the test says.
"""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from serve_helpers import GrpcContext, StandIn

from calid.text import encode_prompt
from calid.v1 import calid_pb2 as pb
from serve_app.cluster.config import AppConfig

pytestmark = [pytest.mark.model]

PROMPTS = ["What is the capital of France?", "List three colors of the rainbow.", "Name a prime number."]
POISON = "Write the word poison."


class _Target(StandIn):
    """Serve's target handle, in process, around a real TargetWorker."""

    def __init__(self, worker, poison_ids=None, hang_first=False):
        self.worker, self.poison_ids, self.hang_first = worker, poison_ids, hang_first
        self.calls: list[tuple[list, None]] = []  # verify calls' tasks, as the worker saw them
        self.verify_calls: list = []  # every verify call, as the router holds it

    def sent(self, method, call):
        if method == "verify":
            self.verify_calls.append(call)

    async def _verify(self, tasks, report=None):
        call_no = len(self.calls)
        self.calls.append((tasks, None))
        if self.hang_first and call_no == 0:
            await asyncio.Event().wait()  # a hung replica: never answers
        if self.poison_ids and any(t.token_ids[: len(self.poison_ids)] == self.poison_ids for t in tasks):
            from ray.exceptions import RayTaskError

            raise RayTaskError("verify", "Traceback: ...", ValueError("token 7 broke the kernel"))
        return self.worker.verify(tasks)

    async def _release(self, ids, final=None):
        self.worker.release(ids, final)

    async def _costs(self):
        return {}


@pytest.fixture(scope="module")
def target():
    from calid.backends import open_model

    cfg = AppConfig.small(draft=None)
    return open_model(cfg.target, cfg.target_backend, cfg.dtype, log=lambda line: None)


def _router(handle, **overrides):
    from serve_app.router.router import Router

    cfg = AppConfig.small(draft=None, **overrides).model_dump()
    return Router.func_or_class(cfg, None, handle)


def _worker(target):
    from calid.workers import TargetWorker

    return TargetWorker(target.runner)


async def _generate(router, prompt, ctx=None):
    ctx = ctx or GrpcContext()
    resp = await router.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=12, ignore_eos=True), ctx)
    return ctx, resp


def test_a_deterministic_worker_error_fails_only_its_request(target):
    """The poisoned request ends INTERNAL with the worker's message at once (no retries with backoff); the
    requests batched with it finish with exactly the tokens of a run without it."""
    async def run(poison):
        handle = _Target(_worker(target), encode_prompt(target.tokenizer, POISON) if poison else None)
        router = _router(handle)
        normal = [asyncio.ensure_future(_generate(router, p)) for p in PROMPTS]
        while len(router.orch.active) < len(PROMPTS):  # the poisoned request joins their running batch
            await asyncio.sleep(0.005)
        out = await asyncio.gather(*normal, *([_generate(router, POISON)] if poison else []))
        return out, handle, router

    clean, _, _ = asyncio.run(run(False))
    out, handle, router = asyncio.run(run(True))
    for (ctx, resp), (_, want) in zip(out, clean):
        assert ctx.code is None and list(resp.token_ids) == list(want.token_ids) and len(resp.token_ids) == 12
    ctx, resp = out[-1]
    assert ctx.code == grpc.StatusCode.INTERNAL and "token 7 broke the kernel" in ctx.message
    poison_ids = encode_prompt(target.tokenizer, POISON)
    tried = [ts for ts, _ in handle.calls if any(t.token_ids[: len(poison_ids)] == poison_ids for t in ts)]
    assert [len(ts) for ts in tried] == [4, 1]  # the batch once, then alone once: not retried
    assert not router.orch.active and not router._requests


def test_a_hung_worker_call_times_out_is_cancelled_and_retried(target):
    async def run():
        handle = _Target(_worker(target), hang_first=True)
        router = _router(handle, worker_call_timeout_s=1.0)
        ctx, resp = await _generate(router, PROMPTS[0])
        return ctx, resp, handle

    ctx, resp, handle = asyncio.run(run())
    want = asyncio.run(_generate(_router(_Target(_worker(target))), PROMPTS[0]))[1]
    assert ctx.code is None and list(resp.token_ids) == list(want.token_ids)
    assert len(handle.verify_calls) > 1  # retried after the timeout...
    assert handle.verify_calls[0].cancelled and not any(
        c.cancelled for c in handle.verify_calls[1:]
    )  # ...which cancelled it


def test_a_request_the_backlog_would_make_late_is_refused_with_when_to_retry(target):
    """Overload: with the one slot busy, requests are admitted while the work ahead of each (at max_new_tokens)
    fits in request_timeout_s at the rate the router measured, and the rest are refused RESOURCE_EXHAUSTED
    with a retry time, before any of it can time out; once the backlog is gone, the same request is admitted."""
    from serve_app.ingress.frontdoor import Caller, Refused

    timeout_s = 20.0

    def request(max_new_tokens):
        return pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=max_new_tokens, ignore_eos=True)

    async def idle(router):
        while router._requests:
            await asyncio.sleep(0.01)

    async def run():
        router = _router(_Target(_worker(target)), max_active=1, queue_capacity=50, request_timeout_s=timeout_s)
        warm = await router.open(request(4000), Caller())
        while router._backlog.rate.per_s is None:  # a second of steps measures the rate
            await asyncio.sleep(0.01)
        router.close(warm)
        await idle(router)
        per_s = router._backlog.rate.per_s
        running = await router.open(request(int(per_s * timeout_s * 3 / 16)), Caller())
        while running.req.request_id not in router.orch.active:
            await asyncio.sleep(0.01)
        each = int(per_s * timeout_s / 8)
        opened = []
        for _ in range(20):
            try:
                opened.append(await router.open(request(each), Caller()))
            except Refused as e:
                opened.append(e)
        for r in [running, *opened]:
            if not isinstance(r, Refused):
                router.close(r)
        await idle(router)
        again = await router.open(request(each), Caller())
        router.close(again)
        await idle(router)
        return opened, router

    opened, router = asyncio.run(run())
    refused = [r for r in opened if isinstance(r, Refused)]
    # by the rule 6 fit behind the running request (by 6%), give or take its progress and the rate's drift
    assert 4 <= len(opened) - len(refused) <= 8
    first = refused[0]
    assert first.code == grpc.StatusCode.RESOURCE_EXHAUSTED and first.retry_after_s >= 1
    assert f"request_timeout_s={timeout_s:g}" in first.message and "tokens/s" in first.message
    assert asyncio.run(router.stats())["admission"]["refused_late"] == len(refused)


def test_tokenization_runs_off_the_event_loop(target):
    """A prompt stuck in the tokenizer does not stall the router: Health and a refusal answer meanwhile."""
    router = _router(_Target(_worker(target)), max_active=1, queue_capacity=0)
    entered, release = threading.Event(), threading.Event()
    tokenizer = router.tokenizer
    real_call = type(tokenizer).__call__

    class _Slow(type(tokenizer)):
        def __call__(self, *a, **kw):
            entered.set()
            if not release.wait(10):  # only the event loop can release it: on the loop, this deadlocks
                raise RuntimeError("the tokenizer ran on the event loop")
            return real_call(self, *a, **kw)

    tokenizer.__class__ = _Slow

    async def run():
        slow = asyncio.ensure_future(_generate(router, PROMPTS[0]))
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
        health = await asyncio.wait_for(router.Health(pb.HealthRequest()), timeout=5)
        release.set()
        ctx, resp = await slow
        return health, ctx, resp

    try:
        health, ctx, resp = asyncio.run(run())
    finally:
        release.set()
        tokenizer.__class__ = _Slow.__mro__[1]
    assert health.serving and ctx.code is None and len(resp.token_ids) == 12


def test_api_keys(target, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nk-alpha\n\nk-beta\n")
    router = _router(_Target(_worker(target)), api_keys_file=str(keys))

    async def run():
        calls = {}
        for name, metadata in (("none", []), ("unknown", [("authorization", "Bearer k-gamma")]),
                               ("no scheme", [("authorization", "k-alpha")]),
                               ("good", [("authorization", "Bearer k-beta")])):
            calls[name] = (await _generate(router, PROMPTS[1], GrpcContext(metadata)))[0]
        models = GrpcContext()
        await router.ListModels(pb.ListModelsRequest(), models)
        health = await router.Health(pb.HealthRequest(), GrpcContext())
        return calls, models, health

    calls, models, health = asyncio.run(run())
    for name in ("none", "unknown", "no scheme"):
        assert calls[name].code == grpc.StatusCode.UNAUTHENTICATED, name
    assert "Bearer <key>" in calls["none"].message
    assert calls["good"].code is None
    assert models.code == grpc.StatusCode.UNAUTHENTICATED
    assert health.serving  # probes need no key


def test_a_key_source_without_keys_refuses_to_start(tmp_path):
    from serve_app.cluster.config import ConfigError, check_auth

    empty = tmp_path / "keys"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="no API key found"):
        check_auth(AppConfig.small(api_keys_file=str(empty)))
    with pytest.raises(ConfigError, match="No such file"):
        check_auth(AppConfig.small(api_keys_file=str(tmp_path / "missing")))


def test_drain_finishes_what_is_in_flight_and_admits_nothing(target):
    async def run():
        router = _router(_Target(_worker(target)))
        inflight = asyncio.ensure_future(_generate(router, PROMPTS[2]))
        while not router.orch.active:
            await asyncio.sleep(0.01)
        await router.drain()
        refused = await _generate(router, PROMPTS[0])
        health = await router.Health(pb.HealthRequest())
        return await inflight, refused, health, router

    (ctx, resp), (refused, _), health, router = asyncio.run(run())
    assert ctx.code is None and len(resp.token_ids) == 12
    assert refused.code == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.message
    assert not health.serving and not router._requests


def test_ttft_counts_from_arrival_including_the_wait_for_a_slot(target):
    """With one decoding slot, the second request waits for the first to finish; its TTFT includes that wait
    (metrics and the response's stats count from arrival, not from admission)."""
    async def run():
        router = _router(_Target(_worker(target)), max_active=1)
        started = time.perf_counter()  # request 1 arrives after this
        first = asyncio.ensure_future(_generate(router, PROMPTS[0]))
        while not router.orch.active:
            await asyncio.sleep(0.001)
        sent = time.perf_counter()
        (_, a), (_, b) = await asyncio.gather(first, _generate(router, PROMPTS[1]))
        return a, b, sent - started, time.perf_counter() - sent

    a, b, head_start, waited = asyncio.run(run())
    # request 2 arrived just after `sent` and queued behind the rest of request 1, which ended (by its own
    # stats) at least a.total_ms after `started`. Request 1's task is not the clock: the stand-in target
    # verifies on the event loop, so request 1's coroutine may resume only after request 2's steps.
    assert b.stats.ttft_ms >= a.stats.total_ms - head_start * 1000 - 50
    assert b.stats.total_ms <= waited * 1000 + 50
