"""The gateway side of collaborative edge drafting: calid.v1 Collaborate (see the proto for the protocol).

The client drafts with its own small model; the router keeps the request in its request cache like
any other and advances it in the shared step loop whenever the client's round has arrived:
filter rounds are accepted at once where their confidence clears the threshold, and what needs the
target joins the same batched target call as every other request (calid.edge explains the rules).
No draft model runs in the cluster for these requests. A client that sends a malformed round, stalls
past edge_round_timeout_s or hangs up ends only its own request, whose state is freed at once.
"""
from __future__ import annotations

import asyncio
import itertools
import time

import grpc

from calid.edge import EDGE_MODES, EdgeRound, check_round
from calid.errors import InvalidRequestError
from calid.v1 import calid_pb2 as pb
from serve_app.ingress import protocol
from serve_app.router.calls import Failure, RequestRefused, RoundEnd
from serve_app.ingress.frontdoor import Refused, grpc_caller, set_grpc_status

_TIMEOUT = object()


async def collaborate(router, stream, grpc_context):
    def refuse(code: grpc.StatusCode, message: str, mode: str = "default"):
        set_grpc_status(grpc_context, router.refuse(mode, code, message, "edge"))
        return RequestRefused(message)

    first = await _receive(stream, router.cfg.edge_round_timeout_s)
    if first is None:
        return  # the client hung up before opening
    if first is _TIMEOUT:
        raise refuse(grpc.StatusCode.DEADLINE_EXCEEDED, "no open message within edge_round_timeout_s")
    if first.WhichOneof("kind") != "open":
        raise refuse(grpc.StatusCode.INVALID_ARGUMENT, "the first Collaborate message must be open")
    msg = first.open
    if msg.HasField("min_agreement"):  # the client's draft applies the threshold; the target audits nothing
        raise refuse(grpc.StatusCode.INVALID_ARGUMENT, "min_agreement is served by Generate, not Collaborate "
                     "(an edge client drafts with a fixed threshold)")
    msg.mode = msg.mode or ("filter" if msg.HasField("max_quality_loss") else "speculative")
    if msg.mode not in EDGE_MODES:
        raise refuse(grpc.StatusCode.INVALID_ARGUMENT,
                     f"Collaborate mode must be one of {', '.join(EDGE_MODES)}, got {msg.mode!r}")
    try:
        r = await router.open(msg, grpc_caller(grpc_context, "edge"), edge=True)
    except Refused as e:
        set_grpc_status(grpc_context, e)
        raise RequestRefused(e.message) from None
    req, mode = r.req, r.req.decode.mode
    try:
        opening = pb.CollaborateReply(request_id=r.client_id, round=0, prompt_ids=req.prompt_ids,
                                      threshold=req.decode.top1)
        if mode == "speculative":  # the target's first token comes at once, as without a draft (TTFT)
            r.round = EdgeRound([])
            router.wake()
            if await _collect(router, r, opening, 0, refuse):
                yield opening
                return
        produced, kept = len(opening.token_ids), 0
        opening.max_draft = max_draft = router.orch.round_budget(req, produced)
        yield opening
        for number in itertools.count(1):
            wait = min(router.cfg.edge_round_timeout_s, r.deadline - time.monotonic())
            m = await _receive(stream, max(0.0, wait))
            if m is None:
                return  # the client hung up: the finally frees the request
            if m is _TIMEOUT:
                raise refuse(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"no draft round {number} within edge_round_timeout_s="
                             f"{router.cfg.edge_round_timeout_s:g}; the request was freed", mode)
            try:
                draft = _round_of(m, number)
                check_round(draft, mode=mode, vocab_size=router.vocab_size, max_draft=max_draft,
                            sampled=not req.params.warp.greedy)
            except InvalidRequestError as e:
                raise refuse(grpc.StatusCode.INVALID_ARGUMENT, f"round {number}: {e}", mode) from None
            r.round = draft
            router.wake()
            reply = pb.CollaborateReply(request_id=r.client_id, round=number)
            if await _collect(router, r, reply, kept, refuse):
                yield reply
                return
            kept += reply.accepted
            produced += len(reply.token_ids)
            reply.max_draft = max_draft = router.orch.round_budget(req, produced)
            yield reply
    finally:
        r.round = None
        router.close(r)


async def _collect(router, r, reply: pb.CollaborateReply, kept: int, refuse) -> bool:
    """Fill ``reply`` with what the step loop made of ``r``'s round; True when the request finished
    (``kept``: draft tokens accepted in earlier rounds). A failure raises, with the status set."""
    async for item in router.events(r):
        if isinstance(item, Failure):
            raise refuse(item.code, item.message, r.mode)
        if isinstance(item, RoundEnd):
            reply.accepted = item.accepted
            continue
        reply.text += item.text
        reply.token_ids.extend(item.token_ids)
        if item.result is not None:
            reply.accepted = item.result.stats.draft_tokens - kept
            reply.finish_reason = item.result.finish_reason
            reply.stats.CopyFrom(protocol.stats(item.result, r.mode))
            return True
    return False


async def _receive(stream, timeout_s: float):
    """The client's next message; None when it closed its side, _TIMEOUT when none came in time."""
    try:
        return await asyncio.wait_for(stream.__anext__(), timeout_s)
    except StopAsyncIteration:
        return None
    except asyncio.TimeoutError:
        return _TIMEOUT


def _round_of(m: pb.CollaborateRequest, number: int) -> EdgeRound:
    if m.WhichOneof("kind") != "round":
        raise InvalidRequestError("after open, every message must be a round")
    d = m.round
    if d.round != number:
        raise InvalidRequestError(f"rounds go in order: expected round {number}, got {d.round}")
    return EdgeRound(list(d.tokens), list(d.confidence), [(list(row.ids), list(row.probs)) for row in d.rows])
