"""What a front-end reads from the router for one request: ``outputs(router, r, stream)``.

The router's step loop puts a request's StreamEvents on its queue; this turns them into ``Output``s, the
unit every front-end translates (gRPC chunks or responses, OpenAI SSE chunks or JSON), and adds what the
step loop does not make: log-probabilities (one target ``score`` call over the new tokens, on the replica
that holds the request's cache) and, with echo, the prompt's. A stream gets an Output per burst: the events
queued when it reads (a target call's run of plain steps, a step's accepted draft) go out as one chunk, not one
message per token through the front-end and Serve's proxy; a non-stream call one Output with everything (and
one score call). A Failure ends the sequence (a stream's tokens queued ahead of it go out first); ``IDLE`` says
nothing happened for ``idle_s`` (SSE keep-alives).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from calid.generation import DecodeStats, GenerationResult
from calid.workers.messages import ScoreTask
from calid.v1 import calid_pb2 as pb
from serve_app.ingress import protocol
from serve_app.router.calls import Failure

IDLE = "idle"  # compared by value: an object() sentinel lost its identity across Ray's pickling of the router


@dataclass
class Output:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)  # one per token id, when asked for
    result: GenerationResult | None = None  # on the last Output only
    prompt_ids: list[int] = field(default_factory=list)  # echo: on the first Output only
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)  # echo: one per prompt id after the first

    def chunk(self, request_id: str, mode: str) -> pb.GenerateChunk:
        c = pb.GenerateChunk(request_id=request_id, text=self.text, token_ids=self.token_ids, logprobs=self.logprobs,
                             prompt_ids=self.prompt_ids, prompt_logprobs=self.prompt_logprobs)
        if self.result is not None:
            c.finish_reason = self.result.finish_reason
            c.stats.CopyFrom(protocol.stats(self.result, mode))
        return c

    def response(self, request_id: str, mode: str) -> pb.GenerateResponse:
        return pb.GenerateResponse(request_id=request_id, text=self.text, token_ids=self.token_ids,
                                   finish_reason=self.result.finish_reason, stats=protocol.stats(self.result, mode),
                                   logprobs=self.logprobs, prompt_ids=self.prompt_ids,
                                   prompt_logprobs=self.prompt_logprobs)


async def outputs(router, r, stream: bool, idle_s: float | None = None):
    """``r``'s Outputs (see the module doc); the caller closes ``r`` afterwards."""
    prompt = list(r.req.prompt_ids)
    head = Output()
    if r.echo:
        head.prompt_ids = prompt
        if len(prompt) > 1:
            scored = await _score(router, r, prompt, 1)
            if isinstance(scored, Failure):
                yield scored
                return
            head.prompt_logprobs = scored
    if r.score_only:
        head.result = GenerationResult(r.req.request_id, len(prompt), [], "", "length", 0.0,
                                       time.perf_counter() - r.arrived, DecodeStats())
        yield head
        return
    ids, pending = list(prompt), head
    async for item in router.events(r, idle_s):
        if item == IDLE:
            yield item
            continue
        if isinstance(item, Failure):
            if stream and pending.token_ids:  # tokens queued ahead of the failure still reach the client,
                await _add_logprobs(router, r, ids, pending)  # scored as asked if that still works
                yield pending
            yield item
            return
        pending.text += item.text
        pending.token_ids += item.token_ids
        ids += item.token_ids
        if item.result is not None or (stream and r.events.empty()):  # a stream: one Output per burst
            failed = await _add_logprobs(router, r, ids, pending)
            if failed is not None:
                yield failed
                return
            pending.result = item.result
            yield pending
            if item.result is not None:
                return
            pending = Output()


async def _add_logprobs(router, r, ids: list[int], pending: Output) -> Failure | None:
    """Score ``pending``'s tokens (the last of ``ids``) into it, if ``r`` asked for log-probabilities."""
    if r.logprobs is None or not pending.token_ids:
        return None
    scored = await _score(router, r, ids, len(ids) - len(pending.token_ids))
    if isinstance(scored, Failure):
        return scored
    pending.logprobs = scored
    return None


async def _score(router, r, ids: list[int], start: int) -> list[pb.TokenLogprob] | Failure:
    """Log-probabilities of ``ids[start:]`` from a target replica (the one holding ``r``'s cache, if any)."""
    task = ScoreTask(r.req.request_id, ids, start, r.logprobs or 0)
    replica = router.calls.replica_of("target", r.req.request_id)
    timeout = min(router.cfg.worker_call_timeout_s, r.deadline - time.monotonic())
    late = Failure(grpc.StatusCode.DEADLINE_EXCEEDED, "scoring log-probabilities did not finish in time")
    if timeout <= 0:  # past its deadline: no call the replica would work on only for it to be cancelled
        return late
    try:
        result = (await asyncio.wait_for(router.target.score.remote([task], replica=replica), timeout))[0]
    except asyncio.TimeoutError:
        return late
    except Exception as e:  # a lost replica: the request's text is fine, but its logprobs cannot be had now
        return Failure(grpc.StatusCode.UNAVAILABLE, f"scoring log-probabilities failed: {e!r}")
    return [pb.TokenLogprob(token_id=t, logprob=lp, top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in top])
            for t, lp, top in zip(ids[start:], result.logprobs, result.top)]
