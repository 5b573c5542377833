"""serve_app.ingress.outputs: what a front-end reads for one request, from the events the step loop queues (by hand:
a stand-in router whose event feed reads the request's queue as the router's does)."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc

from calid.generation import DecodeStats, GenerationResult, StreamEvent
from calid.workers.messages import ScoreResult
from serve_app.router.calls import Failure
from serve_app.ingress.outputs import Output, outputs


class _Router:
    """Its target scores a token id t at log-probability -t."""

    def __init__(self, scoring_fails: bool = False):
        self.scoring_fails = scoring_fails
        self.cfg = SimpleNamespace(worker_call_timeout_s=5.0)
        self.calls = SimpleNamespace(replica_of=lambda role, request_id: None)
        self.scored: list[list[int]] = []  # the ids each score call was asked to score
        self.target = SimpleNamespace(score=SimpleNamespace(remote=self._remote))

    def _remote(self, tasks, replica=None):
        """Like a Serve handle's ``.remote``, the call is issued here, before anything awaits its result."""
        (t,) = tasks
        self.scored.append(t.token_ids[t.start:])
        return self._score(t)

    async def _score(self, t):
        if self.scoring_fails:
            raise ConnectionError("target replica lost")
        return [
            ScoreResult(t.request_id, [-float(i) for i in t.token_ids[t.start :]], [[] for _ in t.token_ids[t.start :]])
        ]

    async def events(self, r, idle_s=None):
        while True:
            item = await r.events.get()
            yield item
            if isinstance(item, Failure) or item.result is not None:
                return


def _request(logprobs: int | None = None, left_s: float = 60.0) -> SimpleNamespace:
    req = SimpleNamespace(request_id="r", prompt_ids=[1, 2])
    return SimpleNamespace(req=req, events=asyncio.Queue(), echo=False, score_only=False, logprobs=logprobs,
                           deadline=time.monotonic() + left_s)


def _event(token: int, last: bool = False) -> StreamEvent:
    result = GenerationResult("r", 2, [], "", "length", 0.0, 0.0, DecodeStats()) if last else None
    return StreamEvent("r", f"<{token}>", [token], result)


def _read(feed, stream: bool, router: _Router | None = None, logprobs: int | None = None,
          left_s: float = 60.0) -> list:
    """Outputs of a request whose events ``feed`` puts on its queue in bursts (a list per burst, with a pause
    between bursts for the reader to catch up)."""
    async def main():
        r, got = _request(logprobs, left_s), []

        async def producer():
            for burst in feed:
                for item in burst:
                    r.events.put_nowait(item)
                await asyncio.sleep(0.01)

        task = asyncio.get_running_loop().create_task(producer())
        async for out in outputs(router or _Router(), r, stream=stream):
            got.append(out)
        await task
        return got

    return asyncio.run(main())


def test_a_stream_sends_each_burst_of_events_as_one_output():
    """A target call's run of plain steps queues its tokens at once: they go out as one chunk, not a message per
    token through the front-end and the proxy; the request's last event closes the last chunk."""
    got = _read([[_event(5), _event(6), _event(7)], [_event(8)], [_event(9), _event(10, last=True)]], stream=True)
    assert [o.token_ids for o in got] == [[5, 6, 7], [8], [9, 10]]
    assert [o.text for o in got] == ["<5><6><7>", "<8>", "<9><10>"]
    assert [o.result is not None for o in got] == [False, False, True]


def test_tokens_queued_ahead_of_a_failure_reach_the_stream_before_it():
    failure = Failure(grpc.StatusCode.UNAVAILABLE, "target lost")
    got = _read([[_event(5)], [_event(6), _event(7), failure]], stream=True)
    assert [o.token_ids for o in got[:-1]] == [[5], [6, 7]] and got[-1] is failure


def test_a_call_without_stream_gets_one_output_with_everything():
    got = _read([[_event(5), _event(6)], [_event(7, last=True)]], stream=False)
    assert len(got) == 1 and isinstance(got[0], Output)
    assert got[0].token_ids == [5, 6, 7] and got[0].result is not None


def test_tokens_queued_ahead_of_a_failure_carry_their_logprobs():
    """A request that asked for log-probabilities gets them on every token it is sent, the failure path too."""
    router, failure = _Router(), Failure(grpc.StatusCode.UNAVAILABLE, "draft lost")
    got = _read([[_event(5)], [_event(6), _event(7), failure]], stream=True, router=router, logprobs=0)
    assert router.scored == [[5], [6, 7]]
    assert [[lp.logprob for lp in o.logprobs] for o in got[:-1]] == [[-5.0], [-6.0, -7.0]] and got[-1] is failure


def test_tokens_queued_ahead_of_a_failure_reach_the_stream_even_if_scoring_them_fails():
    """Nothing the request produced is lost: where their log-probabilities cannot be had any more (the target
    went with the failure), the tokens still go out, without them, and then the failure."""
    failure = Failure(grpc.StatusCode.UNAVAILABLE, "target lost")
    got = _read([[_event(6), _event(7), failure]], stream=True, router=_Router(scoring_fails=True), logprobs=0)
    assert [o.token_ids for o in got[:-1]] == [[6, 7]] and got[0].logprobs == [] and got[-1] is failure


def test_a_request_past_its_deadline_asks_no_replica_to_score_its_last_tokens():
    """A timed-out request's queued tokens still go out, without log-probabilities: a score call for it would
    only be cancelled at once, after the target replica had taken it on."""
    router, failure = _Router(), Failure(grpc.StatusCode.DEADLINE_EXCEEDED, "request_timeout_s")
    got = _read([[_event(6), _event(7), failure]], stream=True, router=router, logprobs=0, left_s=-1.0)
    assert router.scored == []
    assert [o.token_ids for o in got[:-1]] == [[6, 7]] and got[0].logprobs == [] and got[-1] is failure
