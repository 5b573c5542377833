"""How much to draft: forward cost models and a step planner (pure; no ray, no model).

Speculation pays only when verifying a draft costs less than the target steps
it saves. That depends on the machine: on a 2-core CPU a llama.cpp target
verifies 9 tokens in about 5x the time of one (its small-batch matmuls are
compute-bound), on a GPU in about 1x. So the amount to draft is planned every
step from measured costs, not fixed.

Terms:
  CostTable      seconds of one forward as a function of the tokens in it, from
                 measurements (calibration, then live timings, smoothed),
                 interpolated between measured sizes;
  acceptance     a request's running estimate alpha of the chance that its next
                 draft token is accepted (i.i.d. model: after g draft tokens the
                 target yields (1 - alpha^(g+1)) / (1 - alpha) tokens on average);
  lookahead gain a request's running estimate of the draft tokens a Lookahead step
                 (drafts from the target's n-gram trie, no draft model) gets accepted;
  plan           per request a draft length g_i (0 = a plain target step) or LOOKAHEAD,
                 maximising the expected tokens per second of the whole step:
                   sum_i E_i / (draft time + target time)
                 E_i = (1 - alpha^(g+1)) / (1 - alpha) for a draft chain, 1 + gain for Lookahead;
                 draft time = sum over depths d <= max g of draft_step(#requests with g_i >= d),
                 target time = verify(sum_i (1 + g_i or 1 + Lookahead nodes) tokens).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

SMOOTHING = 0.3  # weight of a new timing in a size's running estimate
LOOKAHEAD = -1  # a plan entry: a Lookahead step instead of a draft chain


@dataclass
class CostTable:
    """Seconds of a forward by its size (tokens, or sequences for a draft step)."""

    sizes: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def observe(self, size: int, seconds: float) -> None:
        if size < 1 or seconds <= 0:
            return
        i = bisect.bisect_left(self.sizes, size)
        if i < len(self.sizes) and self.sizes[i] == size:
            self.seconds[i] += SMOOTHING * (seconds - self.seconds[i])
        else:
            self.sizes.insert(i, size)
            self.seconds.insert(i, seconds)

    @property
    def known(self) -> bool:
        return bool(self.sizes)

    def __call__(self, size: float) -> float:
        """Interpolated seconds for ``size``; beyond the measured range, proportional to the nearest size."""
        if not self.sizes or size <= 0:
            return 0.0
        xs, ys = self.sizes, self.seconds
        if size <= xs[0]:
            return ys[0] if len(xs) == 1 or size >= 1 else ys[0] * size
        if size >= xs[-1]:
            return ys[-1] * size / xs[-1]
        i = bisect.bisect_right(xs, size)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (size - x0) / (x1 - x0)

    def as_dict(self) -> dict[int, float]:
        return dict(zip(self.sizes, self.seconds))


@dataclass
class Acceptance:
    """Running estimate of the per-token acceptance chance (Beta(1, 1) prior, exponentially forgotten)."""

    accepted: float = 0.0
    rejected: float = 0.0
    decay: float = 0.9

    def observe(self, accepted: int, proposed: int) -> None:
        if proposed <= 0:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + (1 if accepted < proposed else 0)

    @property
    def alpha(self) -> float:
        return (self.accepted + 1.0) / (self.accepted + self.rejected + 2.0)


@dataclass
class Gain:
    """Running mean of draft tokens accepted per Lookahead step. The prior (half a token) makes an untried
    Lookahead worth a try where verifying extra tokens is nearly free (a GPU) and no draft chain does better
    (a fresh draft's prior acceptance, 0.5, promises about 2 tokens at gamma 6), and not where verifying costs
    several decodes (a small CPU); the mean then follows what the trie actually yields."""

    mean: float = 0.5
    decay: float = 0.8

    def observe(self, accepted: int) -> None:
        self.mean = self.decay * self.mean + (1 - self.decay) * accepted


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a verification yields on average after ``gamma`` draft tokens (accepted + the target's one)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class PlanInput:
    alpha: float  # acceptance estimate
    cap: int  # most draft tokens allowed (the request's gamma, its remaining budget); also Lookahead's nodes
    lookahead_gain: float | None = None  # expected accepted tokens of a Lookahead step; None: not an option


def _tokens(r: PlanInput, g: int) -> float:
    return 1.0 + r.lookahead_gain if g == LOOKAHEAD else expected_tokens(r.alpha, g)


def step_rate(gammas: list[int], reqs: list[PlanInput], verify: CostTable, draft_step: CostTable,
              fixed_tokens: int = 0) -> float:
    """Expected tokens per second of a step drafting ``gammas`` (``fixed_tokens``: other work in the forward)."""
    tokens = sum(_tokens(r, g) for r, g in zip(reqs, gammas))
    depth = max(gammas, default=0)
    draft = sum(draft_step(sum(g >= d for g in gammas)) for d in range(1, depth + 1))
    verified = sum(1 + (r.cap if g == LOOKAHEAD else g) for r, g in zip(reqs, gammas))
    seconds = draft + verify(fixed_tokens + verified)
    return tokens / seconds if seconds > 0 else 0.0


def plan_gammas(reqs: list[PlanInput], verify: CostTable, draft_step: CostTable, fixed_tokens: int = 0,
                passes: int = 2) -> list[int]:
    """Draft lengths (or LOOKAHEAD) maximising ``step_rate`` (coordinate ascent from all-zero: a busy or
    slow-to-verify target drafts nothing; an idle one with good acceptance drafts long). Draft chains are
    options only with a draft cost known (a draft model), Lookahead only where ``lookahead_gain`` is given."""
    gammas = [0] * len(reqs)
    if not verify.known:
        return gammas
    best = step_rate(gammas, reqs, verify, draft_step, fixed_tokens)
    for _ in range(passes):
        changed = False
        for i, r in enumerate(reqs):
            options = list(range(r.cap + 1)) if draft_step.known else [0]
            if r.lookahead_gain is not None and r.cap > 0:
                options.append(LOOKAHEAD)
            for g in options:
                if g == gammas[i]:
                    continue
                trial = gammas[:i] + [g] + gammas[i + 1:]
                rate = step_rate(trial, reqs, verify, draft_step, fixed_tokens)
                if rate > best * (1 + 1e-9):
                    best, gammas, changed = rate, trial, True
        if not changed:
            break
    return gammas
