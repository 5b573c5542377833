"""The router when its draft workers cannot be reached (their node lost, every replica restarting), in process:
real SmolLM2 draft (self:16) and target workers behind stand-ins for Serve's handles, the draft's switchable
between answering and failing as a dead actor does. tests/multinode loses a real draft node."""
from __future__ import annotations

import asyncio
import time

import pytest
from serve_helpers import GrpcContext, StandIn

from calid.v1 import calid_pb2 as pb
from serve_app.cluster.config import AppConfig

pytestmark = [pytest.mark.model]
PROMPTS = ["What is the capital of France?", "List three colors of the rainbow.", "Name a prime number."]


class _Worker(StandIn):
    def __init__(self, worker, role: str):
        self.worker, self.role = worker, role
        self.down = False
        self.answered = 0  # draft/verify calls answered
        self.refused = 0  # calls refused while down

    def _check(self):
        if self.down:
            from ray.exceptions import RayActorError

            self.refused += 1
            raise RayActorError()

    async def _draft(self, tasks, report=None):
        self._check()
        self.answered += 1
        return self.worker.draft(tasks)

    async def _verify(self, tasks, report=None):
        self._check()
        self.answered += 1
        return self.worker.verify(tasks)

    async def _whoami(self):
        self._check()
        return f"{self.role}-1"

    async def _release(self, ids, final=None):
        if not self.down:
            self.worker.release(ids, final) if self.role == "target" else self.worker.release(ids)

    async def _costs(self):
        return {}


@pytest.fixture(scope="module")
def models():
    from calid.backends import open_draft, open_model

    cfg = AppConfig.small(dtype="fp32")
    target = open_model(cfg.target, "torch", "fp32", log=lambda line: None)
    return target, open_draft(cfg.draft, target, dtype="fp32", log=lambda line: None)


def _handles(models):
    from calid.workers import DraftWorker, TargetWorker

    target, draft = models
    return _Worker(DraftWorker(draft.runner, draft.eos_ids), "draft"), _Worker(TargetWorker(target.runner), "target")


async def _generate(router, prompt, mode, tokens=24):
    ctx = GrpcContext()
    resp = await router.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=tokens, ignore_eos=True,
                                                    mode=mode), ctx)
    return ctx, list(resp.token_ids)


async def _until(cond, jobs, timeout_s: float = 120.0) -> None:
    """Wait for ``cond`` while the requests run; fail (rather than hang) if they end first or it takes too long."""
    end = time.monotonic() + timeout_s
    while not cond():
        assert not all(j.done() for j in jobs), "every request ended before the condition held"
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.005)


def test_requests_go_on_without_an_unreachable_draft_and_drafting_resumes_when_it_answers(models, monkeypatch):
    """Greedy speculative and auto requests keep their exact output while the draft is gone (their steps are
    target-only), and draft again once a probe hears from a draft replica."""
    import serve_app.router.router as router_mod
    from serve_app.router.router import Router

    monkeypatch.setattr(router_mod, "DRAFT_PROBE_S", 0.05)

    async def run(lose_after: int | None):
        draft, target = _handles(models)
        router = Router.func_or_class(AppConfig.small(dtype="fp32").model_dump(), draft, target)
        jobs = [
            asyncio.ensure_future(_generate(router, p, m, tokens=64)) for p in PROMPTS for m in ("speculative", "auto")
        ]
        seen = {}
        if lose_after is not None:
            await _until(lambda: target.answered >= lose_after, jobs)
            draft.down = True
            # target-only calls while the draft is gone (plain steps: runs of several tokens a call)
            await _until(lambda: target.answered >= lose_after + 3, jobs)
            seen["available"] = router.orch.draft_available
            seen["answered"] = draft.answered
            draft.down = False
        out = await asyncio.gather(*jobs)
        seen["resumed"] = draft.answered > seen.get("answered", 0)
        return out, seen, router, draft

    want, _, _, _ = asyncio.run(run(None))
    got, seen, router, draft = asyncio.run(run(3))
    assert all(ctx.code is None for ctx, _ in got)
    assert [ids for _, ids in got] == [ids for _, ids in want]
    assert draft.refused >= 1 and seen["available"] is False and asyncio.run(router.stats())["draft_lost"] >= 1
    assert router.orch.draft_available and seen["resumed"]  # the probe found it back, and the router drafted again


def test_a_request_that_arrives_while_the_draft_is_gone_is_served(models):
    from serve_app.router.router import Router

    async def run():
        draft, target = _handles(models)
        draft.down = True
        router = Router.func_or_class(AppConfig.small(dtype="fp32").model_dump(), draft, target)
        return await _generate(router, PROMPTS[0], "speculative"), await _generate(router, PROMPTS[0], "ar")

    (ctx, got), (_, ar) = asyncio.run(run())
    assert ctx.code is None and got == ar
