"""The router as an edge gateway (Collaborate), in process: a real SmolLM2 target worker behind a stand-in
for Serve's handle, a router with no draft deployment at all, and clients that draft with a real local
model (the SDK's EdgeSession over the first 16 layers of SmolLM2) or send scripted, hostile rounds.

Proofs: speculative greedy output is the target's token for token; filter at threshold 0 is the draft's
own text with no target call, at threshold 1 the target's; low-confidence requests of several clients
share target calls. Abuse: every malformed round, a stall and a hang-up end only that request, with a
clear status, and leave nothing behind in the router or the target worker.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from calid.decoding.sampling import Warp

from serve_helpers import GrpcContext, StandIn

from calid.v1 import calid_pb2 as pb
from serve_app.cluster.config import AppConfig

pytestmark = [pytest.mark.model]

PROMPTS = ["Write a Python function that checks whether a number is prime.", "List three colors of the rainbow.",
           "What is the capital of France?"]
N = 24


class _Target(StandIn):
    def __init__(self, worker):
        self.worker = worker
        self.verified: list[list] = []  # request ids of every verify call

    async def _verify(self, tasks, report=None):
        self.verified.append([t.request_id for t in tasks])
        return self.worker.verify(tasks)

    async def _release(self, ids, final=None):
        self.worker.release(ids, final)

    async def _costs(self):
        return {}


class _Stream:
    """The client's side of the bidi stream as the router sees it (Serve's gRPCInputStream)."""

    def __init__(self):
        self._q: asyncio.Queue = asyncio.Queue()

    def send(self, m) -> None:
        self._q.put_nowait(m)

    def close(self) -> None:
        self._q.put_nowait(None)

    def __aiter__(self):
        return self

    async def __anext__(self):
        m = await self._q.get()
        if m is None:
            raise StopAsyncIteration
        return m


@pytest.fixture(scope="module")
def models():
    from calid.backends import open_draft, open_model

    cfg = AppConfig.small(draft=None)
    target = open_model(cfg.target, cfg.target_backend, cfg.dtype, log=lambda line: None)
    draft = open_draft("self:16", target, "torch", "fp32", log=lambda line: None)
    return target, draft


@pytest.fixture()
def gateway(models):
    from calid.workers import TargetWorker
    from serve_app.router.router import Router

    def make(**overrides):
        target = _Target(TargetWorker(models[0].runner))
        cfg = AppConfig.small(draft=None, **overrides).model_dump()
        return Router.func_or_class(cfg, None, target), target  # no draft deployment

    return make


def _local(models):
    from calid.client.edge import LocalDraft
    from calid.edge import EdgeDrafter

    draft = models[1]
    return LocalDraft("self:16", drafter=EdgeDrafter(draft.runner, draft.eos_ids))


async def _collaborate(router, local, prompt, **kw):
    """Drive one Collaborate call with the SDK's session; returns (context, replies, output ids)."""
    from calid.client.edge import EdgeSession
    from calid.client.sdk import build_request
    from serve_app.router.calls import RequestRefused

    ctx, stream = GrpcContext(), _Stream()
    session = EdgeSession(local, local.drafter(), build_request(prompt, max_new_tokens=N, ignore_eos=True, **kw))
    stream.send(session.opening())
    replies = []
    try:
        async for reply in router.Collaborate(stream, ctx):
            replies.append(reply)
            following = session.advance(reply)
            if following is None:
                break
            stream.send(following)
    except RequestRefused:
        pass
    finally:
        session.close()
    return ctx, replies, [t for r in replies for t in r.token_ids]


async def _ar(router, prompt):
    ctx = GrpcContext()
    resp = await router.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=N, ignore_eos=True, mode="ar"), ctx)
    assert ctx.code is None, ctx.message
    return list(resp.token_ids)


async def _settled(router, target, timeout_s: float = 10.0) -> bool:
    """Whether the router and the target worker hold no request state (releases are fire-and-forget)."""
    for _ in range(int(timeout_s / 0.05)):
        if not router._requests and not router.orch.active and target.worker.runner.cached_count() == 0:
            return True
        await asyncio.sleep(0.05)
    return False


def test_speculative_at_the_edge_is_the_targets_output_with_no_cluster_draft(gateway, models):
    router, target = gateway()
    local = _local(models)

    async def go():
        ar = [await _ar(router, p) for p in PROMPTS]
        edge = await asyncio.gather(*(_collaborate(router, local, p, mode="speculative") for p in PROMPTS))
        return ar, edge, await _settled(router, target)

    ar, edge, idle = asyncio.run(go())
    assert idle
    accepted = 0
    for want, (ctx, replies, ids) in zip(ar, edge):
        assert ctx.code is None, ctx.message
        assert ids == want
        last = replies[-1]
        assert last.finish_reason == "length" and last.stats.draft_forwards == 0  # no draft ran here
        assert last.stats.draft_tokens == sum(r.accepted for r in replies)
        accepted += last.stats.draft_tokens
        for r in replies[1:]:
            assert r.accepted <= len(r.token_ids) <= r.accepted + 1
    # the edge's drafts were used (self:16 is a weak draft: on an AVX2 machine it had none of its 24
    # proposals accepted for one of the prompts, whose greedy text differs with the CPU's rounding)
    assert accepted > 0
    # the low-confidence rounds of the three clients were verified together
    assert max(len(call) for call in target.verified) > 1


def test_filter_at_the_edge_threshold_zero_is_the_draft_alone_and_one_is_the_target(gateway, models):
    router, target = gateway()
    local = _local(models)
    prompt = PROMPTS[0]

    async def go():
        ar = await _ar(router, prompt)
        calls = len(target.verified)
        zero = await _collaborate(router, local, prompt, mode="filter", threshold=0.0)
        calls = len(target.verified) - calls
        one = await _collaborate(router, local, prompt, mode="filter", threshold=1.0)
        return ar, calls, zero, one, await _settled(router, target)

    ar, zero_calls, (_, zero, zero_ids), (_, one, one_ids), idle = asyncio.run(go())
    draft_alone = local.drafter().draft("alone", list(zero[0].prompt_ids), mode="filter", max_draft=N,
                                        threshold=0.0, warp_params=Warp())
    local.release(local.drafter(), "alone")
    assert zero_ids == draft_alone.tokens and zero_calls == 0 and zero[-1].stats.target_calls == 0
    assert zero[-1].stats.filtered_fraction == 1.0
    assert one_ids == ar and one[-1].stats.draft_tokens == 0 and one[-1].stats.target_calls == N
    assert idle


def _round(number, tokens=(), confidence=(), rows=()):
    r = pb.DraftRound(round=number, tokens=list(tokens), confidence=list(confidence))
    for ids, probs in rows:
        r.rows.add(ids=ids, probs=probs)
    return pb.CollaborateRequest(round=r)


def _open(mode="filter", **kw):
    return pb.CollaborateRequest(open=pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=N, mode=mode, **kw))


def _scripted(gateway_pair, messages, close=False):
    """Send ``messages`` one per reply (the first before any), then stop talking (or hang up); returns the
    context, the replies and whether the router and the worker were left holding nothing."""
    router, target = gateway_pair

    async def go():
        ctx, replies = await _script(router, messages, close)
        return ctx, replies, await _settled(router, target)

    return asyncio.run(go())


async def _script(router, messages, close):
    from serve_app.router.calls import RequestRefused

    ctx, stream, replies = GrpcContext(), _Stream(), []
    stream.send(messages[0])
    rest = list(messages[1:])
    try:
        async for reply in router.Collaborate(stream, ctx):
            replies.append(reply)
            if rest:
                stream.send(rest.pop(0))
            elif close:
                stream.close()
    except RequestRefused:
        pass
    return ctx, replies


V = 49152  # SmolLM2's vocabulary


@pytest.mark.parametrize("messages, words", [
    ([_round(1)], "first Collaborate message must be open"),
    ([_open(mode="ar")], "mode must be one of filter, speculative"),
    ([_open(), _open()], "every message must be a round"),
    ([_open(), _round(2, [1], [0.9])], "expected round 1"),
    ([_open(), _round(1, [V], [0.9])], "outside the vocabulary"),
    ([_open(), _round(1, [1] * 9, [0.9] * 9)], "at most 8"),
    ([_open(), _round(1, [1, 2], [0.9, float("nan")])], "no NaN"),
    ([_open(), _round(1, [1], [7.0])], "[0, 1]"),
    ([_open(), _round(1, [1, 2], [0.9])], "one confidence per token"),
    ([_open("speculative", temperature=1.0), _round(1, [1])], "draft distribution of every token"),
    ([_open("speculative", temperature=1.0), _round(1, [1], rows=[([2], [1.0])])], "no probability"),
])
def test_a_malformed_message_is_invalid_argument_and_frees_the_request(gateway, messages, words):
    ctx, _, idle = _scripted(gateway(), messages)
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and words in ctx.message, ctx.message
    assert idle


def test_a_client_that_stalls_mid_request_is_timed_out_and_freed(gateway):
    # two rounds the target verifies (confidence 0: below the threshold), then silence
    ctx, replies, idle = _scripted(gateway(edge_round_timeout_s=0.5), [_open(threshold=0.5), _round(1, [28], [0.0]),
                                                                        _round(2, [28], [0.0])])
    assert ctx.code == grpc.StatusCode.DEADLINE_EXCEEDED and "edge_round_timeout_s" in ctx.message
    assert [r.round for r in replies] == [0, 1, 2] and all(len(r.token_ids) == 1 for r in replies[1:])
    assert idle


def test_a_client_that_hangs_up_is_freed_without_an_error(gateway):
    ctx, replies, idle = _scripted(gateway(), [_open(threshold=0.5), _round(1, [28], [0.0])], close=True)
    assert ctx.code is None and [r.round for r in replies] == [0, 1]
    assert idle


def test_the_server_trusts_confidences_but_caps_what_a_client_gets(gateway):
    """A client that claims full confidence for junk gets its junk accepted (by design, README), never
    more tokens than max_new_tokens, and every round is answered with at most max_draft more."""
    junk = [_round(k, [7] * 8, [1.0] * 8) for k in range(1, 5)]
    ctx, replies, idle = _scripted(gateway(), [_open(threshold=0.5, ignore_eos=True)] + junk)
    assert ctx.code is None, ctx.message
    ids = [t for r in replies for t in r.token_ids]
    assert ids == [7] * N and replies[-1].finish_reason == "length"
    assert replies[-1].stats.target_calls == 0 and [r.max_draft for r in replies] == [8, 8, 8, 0]
    assert idle


def test_a_stalled_client_holds_up_no_one_else(gateway):
    """A collaborating request waits for its client outside the step loop: others decode meanwhile."""
    from serve_app.router.calls import RequestRefused

    router, target = gateway(edge_round_timeout_s=600)

    async def stalled(stream):
        ctx, replies = GrpcContext(), []
        try:
            async for reply in router.Collaborate(stream, ctx):
                replies.append(reply)
        except RequestRefused:
            pass
        return ctx, replies

    async def go():
        stream = _Stream()
        stream.send(_open("speculative"))
        waiting = asyncio.ensure_future(stalled(stream))
        while not router.orch.active:  # admitted; its opening round (the target's first token) runs
            await asyncio.sleep(0.01)
        served = await _ar(router, PROMPTS[0])
        still_waiting = not waiting.done()
        stream.close()  # the stalled client finally hangs up
        ctx, replies = await waiting
        return served, still_waiting, ctx, replies, await _settled(router, target)

    served, still_waiting, ctx, replies, idle = asyncio.run(go())
    assert len(served) == N and still_waiting
    assert ctx.code is None and len(replies) == 1 and len(replies[0].token_ids) == 1  # the target's first token
    assert idle
