"""Admission by expected finish time: a request that would have to wait for a decoding slot is admitted only
if the work admitted before it, and its own, can be done within the request timeout at the rate the server
is measured to produce tokens.

Work is counted in output tokens at each request's budget (``max_new_tokens``, less what it has produced):
the most it may ask of the server, so an estimate that fits is one the server can keep whatever the answers'
lengths. Prompts are left out: a prefill costs a small share of a decode of the same length. A request that
can start at once (a free slot, nobody queued) is never refused here: waiting is what this bounds.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

MIN_MEASURED_S = 1.0  # no estimate (everything admitted) until the steps measured add up to this


@dataclass
class TokenRate:
    """Output tokens per second of stepping (all requests of a step together), over the last ``window_s``
    seconds spent in steps; time between steps (idle, waiting for work) is not counted, so a quiet spell
    does not make the server look slow."""

    window_s: float = 30.0

    def __post_init__(self):
        self._steps: deque[tuple[int, float]] = deque()  # (tokens, seconds) of each step
        self._tokens, self._seconds = 0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self._steps.append((tokens, seconds))
        self._tokens += tokens
        self._seconds += seconds
        while len(self._steps) > 1 and self._seconds - self._steps[0][1] >= self.window_s:
            old_tokens, old_seconds = self._steps.popleft()
            self._tokens -= old_tokens
            self._seconds -= old_seconds

    @property
    def per_s(self) -> float | None:
        """Tokens per second, or None while fewer than MIN_MEASURED_S of steps were measured."""
        if self._seconds < MIN_MEASURED_S:
            return None
        return self._tokens / self._seconds


@dataclass(frozen=True)
class Verdict:
    """What admission decided: ``finish_s`` is the estimate (None: nothing measured yet); a refused request
    is told to retry after ``retry_after_s``, when the work ahead has shrunk enough for it to fit."""

    admit: bool
    finish_s: float | None = None
    retry_after_s: float = 0.0


@dataclass
class Backlog:
    """The admission rule, given the work ahead in output tokens: see the module docstring."""

    timeout_s: float
    rate: TokenRate = field(default_factory=TokenRate)

    def judge(self, ahead_tokens: int, own_tokens: int, must_wait: bool) -> Verdict:
        per_s = self.rate.per_s
        if per_s is None or per_s <= 0:
            return Verdict(True)
        finish_s = (ahead_tokens + own_tokens) / per_s
        if not must_wait or finish_s <= self.timeout_s:
            return Verdict(True, finish_s)
        return Verdict(False, finish_s, retry_after_s=math.ceil(min(finish_s - self.timeout_s, self.timeout_s)))


def budget_left(max_new_tokens: int, prompt_tokens: int, produced: int, max_position: int) -> int:
    """Output tokens a request may still produce: its max_new_tokens, and the room its context has left."""
    return max(0, min(max_new_tokens, max_position - prompt_tokens) - produced)
