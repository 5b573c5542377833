"""Autoregressive generation over a ModelRunner, batched and streaming.

Requests join a running batch as slots free up (continuous batching); a new
request's prompt prefill shares a forward with the decode steps of the others.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Hashable, Iterator

import torch

from calid.decoding.sampling import Warp, make_generator, sample, warp
from calid.errors import InvalidRequestError
from calid.runtime.runner import ModelRunner, SeqInput
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
        return self

    @property
    def warp(self) -> Warp:
        return Warp(self.temperature, self.top_k, self.top_p)


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: Hashable = None


@dataclass
class GenerationResult:
    request_id: Hashable
    prompt_tokens: int
    output_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "stop" | "length"
    ttft_s: float
    total_s: float

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


class _Active:
    """In-flight state of one request."""

    def __init__(self, req: GenerationRequest, tokenizer, start: float):
        self.req = req
        self.output: list[int] = []
        self.generator = make_generator(req.params.seed)
        self.stream = TextStream(tokenizer, req.params.stop)
        self.start, self.first_token_at = start, None
        self.finish_reason: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.req.prompt_ids + self.output

    def result(self, now: float) -> GenerationResult:
        return GenerationResult(
            self.req.request_id, len(self.req.prompt_ids), self.output, self.stream.text,
            self.finish_reason, (self.first_token_at or now) - self.start, now - self.start,
        )


class ARGenerator:
    """Target-only autoregressive decoding: the baseline every other mode is measured against."""

    def __init__(self, runner: ModelRunner, tokenizer, eos_ids: frozenset[int], max_batch: int = 8):
        self.runner, self.tokenizer, self.eos_ids = runner, tokenizer, eos_ids
        self.max_batch = max_batch
        self.max_position = runner.model.cfg.max_position
        self._ids = itertools.count()

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results = {}
        for event in self.stream(requests):
            if event.result is not None:
                results[event.request_id] = event.result
        return [results[r.request_id] for r in requests]

    def stream(self, requests: list[GenerationRequest]) -> Iterator[StreamEvent]:
        for req in requests:
            if req.request_id is None:
                req.request_id = f"req-{next(self._ids)}"
            validate_request(req, self.max_position)
        waiting = list(requests)
        active: list[_Active] = []
        while waiting or active:
            while waiting and len(active) < self.max_batch:
                active.append(_Active(waiting.pop(0), self.tokenizer, time.perf_counter()))
            yield from self._step(active)
            for seq in [s for s in active if s.finish_reason]:
                self.runner.release(seq.req.request_id)
                active.remove(seq)

    def _step(self, active: list[_Active]) -> Iterator[StreamEvent]:
        inputs = [SeqInput(s.req.request_id, self.runner.sync(s.req.request_id, s.token_ids)) for s in active]
        logits = torch.cat(self.runner.forward(inputs))  # [B, V]
        tokens = self._sample(logits, active)
        now = time.perf_counter()
        for seq, token in zip(active, tokens):
            yield self._append(seq, token, now)

    def _sample(self, logits: torch.Tensor, active: list[_Active]) -> list[int]:
        if all(s.req.params.temperature == 0 for s in active):
            return logits.argmax(-1).tolist()
        return [
            int(sample(warp(row[None], s.req.params.warp), s.generator)[0]) for row, s in zip(logits, active)
        ]

    def _append(self, seq: _Active, token: int, now: float) -> StreamEvent:
        seq.output.append(token)
        seq.first_token_at = seq.first_token_at or now
        params = seq.req.params
        is_eos = token in self.eos_ids and not params.ignore_eos
        text = "" if is_eos else seq.stream.push(token)
        if is_eos:
            seq.finish_reason = "eos"
        elif seq.stream.stopped:
            seq.finish_reason = "stop"
        elif len(seq.output) >= params.max_new_tokens or len(seq.token_ids) >= self.max_position:
            seq.finish_reason = "length"
        if seq.finish_reason:
            text += seq.stream.finish()
            return StreamEvent(seq.req.request_id, text, [token], seq.result(now))
        return StreamEvent(seq.req.request_id, text, [token])
