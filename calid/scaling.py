"""How many draft and target replicas a load needs (pure; serve_app.router.autoscaling feeds it).

Terms:
  token rate          output tokens/s the routers are producing (over a window)
  filtered fraction   output tokens that came from the draft / all output tokens
  target demand       token rate x (1 - filtered fraction): the tokens only the
                      target can supply. A filter deployment that lets the draft
                      answer 80% of tokens needs a fifth of the target capacity
                      that target-only decoding would.
  draft demand        token rate of requests whose mode uses the draft
  pending             calls queued or running at the workers, plus requests
                      waiting in the routers' admission queues; this term
                      catches overload, where the token rate is capped by
                      capacity and understates demand.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass


def target_demand(token_rate: float, filtered_fraction: float) -> float:
    return max(0.0, token_rate) * (1.0 - min(1.0, max(0.0, filtered_fraction)))


def desired_replicas(demand: float, pending: float, tokens_per_replica: float, queue_per_replica: float) -> int:
    """Replicas that absorb ``demand`` tokens/s and keep ``pending`` within one queue per replica.

    Bounds (min/max replicas) and up/down-scale delays are applied by the caller.
    """
    by_rate = math.ceil(demand / tokens_per_replica - 1e-9)
    by_queue = math.ceil(pending / queue_per_replica - 1e-9)
    return max(0, by_rate, by_queue)


@dataclass
class RateWindow:
    """Counts over the last ``window_s`` seconds: tokens from the draft and from the target. The window's sums
    are kept as entries come and go, so a snapshot costs the same however many steps the window holds (the router
    takes one every step: summed anew, 0.05 ms of a step at one request, more the busier it is)."""

    window_s: float = 10.0

    def __post_init__(self):
        self._events: deque[tuple[float, int, int, bool]] = deque()  # (time, draft, target, draft-mode)
        self._draft = self._target = self._drafted = 0  # sums over _events: draft, target, draft-mode tokens

    def add(self, draft_tokens: int, target_tokens: int, uses_draft: bool, now: float | None = None) -> None:
        self._events.append((time.monotonic() if now is None else now, draft_tokens, target_tokens, uses_draft))
        self._count(draft_tokens, target_tokens, uses_draft, +1)

    def _count(self, draft: int, target: int, uses_draft: bool, sign: int) -> None:
        self._draft += sign * draft
        self._target += sign * target
        if uses_draft:
            self._drafted += sign * (draft + target)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            _, draft, target, uses_draft = self._events.popleft()
            self._count(draft, target, uses_draft, -1)

    def snapshot(self, now: float | None = None) -> dict[str, float]:
        now = time.monotonic() if now is None else now
        self._trim(now)
        total = self._draft + self._target
        ff = self._draft / total if total else 0.0
        rate = total / self.window_s
        return {"token_rate": rate, "filtered_fraction": ff, "target_demand": target_demand(rate, ff),
                "draft_demand": self._drafted / self.window_s}
