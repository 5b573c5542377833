"""Request-level types shared by every decoding mode: parameters, state, stats, results.

The loop that drives them is :class:`calid.engine.Engine`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable

from calid.decoding.confidence import Threshold
from calid.decoding.grammar import Grammar
from calid.decoding.modes import DecodeParams
from calid.decoding.sampling import Warp, make_generator
from calid.errors import InvalidRequestError
from calid.text import TextStream


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    grammar: Grammar | None = None  # structured output (calid.decoding.grammar)

    def validate(self) -> "SamplingParams":
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.stop, str):
            raise InvalidRequestError("stop must be a list of strings, not a single string")
        if self.grammar is not None and self.ignore_eos:
            raise InvalidRequestError("ignore_eos cannot be set with a grammar: a complete grammar allows only "
                                      "the end of sequence")
        return self

    @property
    def warp(self) -> Warp:
        return Warp(self.temperature, self.top_k, self.top_p, self.grammar)


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: Hashable = None
    decode: DecodeParams | None = None  # None: the engine's default


@dataclass
class DecodeStats:
    """Where a request's tokens came from, and how well the draft did.

    filtered_fraction   output tokens that came from the draft / all output tokens
    mean_accepted       draft tokens accepted per verification (speculative, rollback)
    accepted_at[i]      times a draft token at position i was accepted, of proposed_at[i]
    """

    draft_tokens: int = 0
    target_tokens: int = 0
    target_calls: int = 0
    prefill_chunks: int = 0  # target forwards that only prefilled part of the prompt (SARATHI)
    draft_calls: int = 0
    verifications: int = 0
    accepted_total: int = 0
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    @property
    def filtered_fraction(self) -> float:
        total = self.draft_tokens + self.target_tokens
        return self.draft_tokens / total if total else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.accepted_total / self.verifications if self.verifications else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    def record_verification(self, proposed: int, accepted: int, verifying: bool) -> None:
        if not verifying or proposed == 0:
            return
        self.verifications += 1
        self.accepted_total += accepted
        grow = proposed - len(self.proposed_at)
        if grow > 0:
            self.proposed_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(proposed):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < accepted


@dataclass
class GenerationResult:
    request_id: Hashable
    prompt_tokens: int
    output_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "stop" | "length"
    ttft_s: float
    total_s: float
    stats: DecodeStats = field(default_factory=DecodeStats)

    @property
    def tokens_per_s(self) -> float:
        return len(self.output_ids) / self.total_s if self.total_s > 0 else 0.0


@dataclass
class StreamEvent:
    request_id: Hashable
    text: str  # new text since the last event of this request
    token_ids: list[int]
    result: GenerationResult | None = None  # set on the request's last event


def validate_request(req: GenerationRequest, max_position: int) -> None:
    req.params.validate()
    if not req.prompt_ids:
        raise InvalidRequestError("prompt is empty")
    if len(req.prompt_ids) >= max_position:
        raise InvalidRequestError(
            f"prompt is {len(req.prompt_ids)} tokens, longer than the model context ({max_position} tokens)"
        )


class RequestState:
    """In-flight state of one request: its token ids (the source of truth), text, RNG, stats."""

    def __init__(self, req: GenerationRequest, tokenizer, eos_ids: frozenset[int], start: float):
        self.req = req
        self.eos_ids = eos_ids
        self.output: list[int] = []
        self._ids = list(req.prompt_ids)  # prompt + output, appended to (token_ids hands it out: do not mutate)
        self.generator = make_generator(req.params.seed)
        self.stream = TextStream(tokenizer, req.params.stop)
        self.start, self.first_token_at = start, None
        self.finish_reason: str | None = None
        self.prefilling = False  # the target is part-way through this prompt (chunked prefill)
        self.stats = DecodeStats()
        self.set_threshold(req.decode.top1 if req.decode else 0.0)

    def set_threshold(self, prob: float) -> None:
        self.threshold = prob
        # 1.0 means "target for every token": never confident, even for a saturated softmax
        self.confidence = Threshold.never() if prob >= 1.0 else Threshold.from_prob(prob)

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output ids so far: the live list (read it; appending is ``append``'s job)."""
        return self._ids

    def append(self, token: int, now: float, from_draft: bool, max_position: int) -> StreamEvent:
        self.output.append(token)
        self._ids.append(token)
        if from_draft:
            self.stats.draft_tokens += 1
        else:
            self.stats.target_tokens += 1
        self.first_token_at = self.first_token_at or now
        params = self.req.params
        is_eos = token in self.eos_ids and not params.ignore_eos
        text = "" if is_eos else self.stream.push(token)
        if is_eos:
            self.finish_reason = "eos"
        elif self.stream.stopped:
            self.finish_reason = "stop"
        elif len(self.output) >= params.max_new_tokens or len(self.token_ids) >= max_position:
            self.finish_reason = "length"
        if self.finish_reason:
            text += self.stream.finish()
            return StreamEvent(self.req.request_id, text, [token], self.result(now))
        return StreamEvent(self.req.request_id, text, [token])

    def extend(self, tokens: list[int], now: float, from_draft: int, decided: tuple[int, ...], max_position: int
               ) -> StreamEvent:
        """``append`` of each token in turn up to the one that finishes the request, as one event: their ids and
        text (tokens before ``from_draft`` came from the draft, but for those at ``decided``)."""
        if self.stream.stop:  # where a stop string ends decides which tokens are output: token by token
            events = []
            for i, token in enumerate(tokens):
                events.append(self.append(token, now, i < from_draft and i not in decided, max_position))
                if self.finish_reason:
                    break
            return StreamEvent(self.req.request_id, "".join(e.text for e in events),
                               [t for e in events for t in e.token_ids], events[-1].result)
        params, taken = self.req.params, []
        for i, token in enumerate(tokens):
            self.output.append(token)
            self._ids.append(token)
            if i < from_draft and i not in decided:
                self.stats.draft_tokens += 1
            else:
                self.stats.target_tokens += 1
            if token in self.eos_ids and not params.ignore_eos:
                self.finish_reason = "eos"
                break
            taken.append(token)
            if len(self.output) >= params.max_new_tokens or len(self._ids) >= max_position:
                self.finish_reason = "length"
                break
        self.first_token_at = self.first_token_at or now
        text = self.stream.push_many(taken)
        ids = tokens[: len(taken) + (self.finish_reason == "eos")]
        if self.finish_reason:
            return StreamEvent(self.req.request_id, text + self.stream.finish(), ids, self.result(now))
        return StreamEvent(self.req.request_id, text, ids)

    def result(self, now: float) -> GenerationResult:
        return GenerationResult(
            self.req.request_id, len(self.req.prompt_ids), self.output, self.stream.text,
            self.finish_reason, (self.first_token_at or now) - self.start, now - self.start, self.stats,
        )
