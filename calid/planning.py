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
  n-gram draft   a chain copied from the request's own earlier tokens (calid.decoding.ngram): no draft
                 time, only its verification; what it yields is read from how long the sequence has
                 already agreed with the copied text (Copy.survival: the chance its first j tokens hold);
  tree acceptance a request's running estimate of the chance that a depth of its token tree
                 holds the target's token (the draft's top-1 plus, where the draft is unsure,
                 its next-best tokens as siblings); a tree verifies more tokens than a chain
  plan           per request a Choice: a plain target step (ar), a draft chain of g tokens
                 (speculative), an n-gram chain of g tokens (ngram), a token tree g deep (tree) or a
                 Lookahead step, maximising the plain decoding time the step saves per second it takes:
                   (C(r) - C(r - E)) / (draft time + target time)
                 E_i = (1 - a^(g+1)) / (1 - a) for a chain (a = alpha) or a tree (a = its acceptance),
                 1 + S(1) + ... + S(g) for an n-gram chain, 1 + gain for Lookahead, 1 for ar;
  cost to go     C(r): seconds that plain steps would take to finish requests with r_i tokens left each: the
                 batch shrinks as the shortest finish, so C(r) = sum_k r_(k) x (v(k) - v(k-1)), r sorted longest
                 first, v(k) a plain step's seconds with k requests (rising). One request: C = r v(1), and the
                 plan maximises tokens per second. In a batch a request's tokens are worth what its row would
                 cost in later plain steps: the request furthest behind saves whole steps (v(1) a token, where it
                 would end up decoding alone), one already ahead of the others only its row (v(n) - v(n-1), on a
                 2-core CPU 20-50 ms against 150-200 ms for 4 rows: 4 requests at 48 tokens, one copying 16
                 tokens ahead of three plain rows, 550 ms for 6 tokens, lost 5% of a burst); all requests
                 drafting together save whole steps again;
                 draft time = sum over depths d of draft_step(draft lanes at depth d: one per
                 chain, tree_chains per tree, over the requests drafting d or more deep),
                 plus the draft model's catch-up on tokens it has not seen, for the requests it drafts for,
                 target time = verify(sum_i tokens verified: 1 + g for a chain (model or n-gram),
                 1 + g * chains + width - 1 for a tree, 1 + nodes for Lookahead), or, for a runtime that
                 splits a batch by length (sliced), the sum of its slices (split_cost).
  spread         a chain's tokens are not its mean: it holds for j tokens with chance S(j) - S(j+1). Where requests
                 have known ends, the planner prices E[C(r - X)] over those outcomes (chains independent; _Spread),
                 not C(r - E[X]): what a burst saves is set by the request that ends up furthest behind, and with
                 four fresh copies one of them likely breaks at once (the rest finish early and leave it decoding in
                 small steps: 90 ms a token against 58 in 4-row steps, grounded c4 on a 2-core CPU).
  slices         llama.cpp with a KV stream per sequence runs a batch as ubatches of equal tokens per sequence over
                 sequences on adjacent slots (llama_batch_allocr::split_equal, sequential): first one slice of
                 every sequence's first tokens, up to the shortest's length (the runner keeps live sequences on
                 adjacent slots), then, for the sequences longer than that, slices over runs of adjacent slots.
                 Each slice reads all the weights. Which requests draft is not up to their slots, so a longer
                 sequence is priced as a slice of its own: one request verifying 16 tokens beside 11 plain ones
                 costs a 12-token forward plus a 16-token one (Qwen 1.5B, 2-core CPU: 593 ms, where a 28-token
                 forward of one sequence costs about 490); 6 such requests on alternate slots, 7 slices.
                 A batch of mixed lengths thus costs up to twice one of equal lengths with as many tokens (16
                 sequences of 1-9 tokens, 72 in all: 1.77 s; 16 of 5 tokens: 0.98 s), so the runner may pad its
                 shorter sequences up to a level (SeqInput.pad: tokens whose cells it drops after the forward):
                 one slice of every sequence's first L tokens, then each longer one's rest. The level is the one
                 of the sequences' lengths that prices the forward lowest (batch_level; the shortest: no padding),
                 and the planner prices every plan at its level, so requests whose chains can run as long as the
                 others' at no cost do.
"""
from __future__ import annotations

import bisect
import functools
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

# the draft depths a plan prices (and each request's deepest): a step at 16 requests priced every depth to 32 (50
# choices a request) in 14 ms of a 330 ms step; on these it prices the same 40 plans, captured there, in half the time
DEPTH_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
SMOOTHING = 0.3  # weight of a new timing in a size's running estimate
# a drafting step's corrected forecast must save at least this share more per second to run: near a tie a plan's
# forecast is noise, and drafting costs the target tokens (Qwen 1.5B, 2-core EPYC, closed loop of 4 clients, 2
# rounds: mix 0.92/1.03x ar at 3%, 1.04/1.06x at 10%; humaneval 1.38/1.27x at 3%, 1.27/1.19x at 10%)
GUARD_MARGIN = 0.10
GUARD_EXPLORE = 24  # one step in this many goes against the guard's verdict, to keep both measures current
GUARD_MIN = 3  # steps of each kind measured before the guard judges
GUARD_PROBE = 4  # until plain steps are measured, one planned drafting step in this many runs plain
GUARD_DECAY = 0.85  # weight of what a kind's earlier steps did, per step after them
# drafting plans' forecasts are corrected apart by the tokens they expect beyond a plain step's (one per request): a
# long copy that has agreed for a while and one shaky token are different bets, and a workload mixes both
DEPTH_EDGES = (1.0, 4.0, float("inf"))
DEPTH_NAMES = ("plain", "drafted<1", "drafted<4", "drafted4+")
SPREAD_ATOMS = 8  # outcomes of a chain kept apart in its expected cost to go (_outcomes)
NO_END = 1 << 16  # tokens left of a request with no known end, beyond the most any request with one has: such
# requests rank alike, behind every other (small numbers: the cost to go is compared to the digit)


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
class Choice:
    """What one request does this step: ``mode`` ar | ngram | speculative | tree | lookahead; ``gamma`` the draft
    depth (ngram, speculative, tree) or Lookahead's trie nodes."""

    mode: str = "ar"
    gamma: int = 0


AR = Choice()


@dataclass(frozen=True)
class PlanInput:
    alpha: float  # acceptance estimate of a draft chain
    cap: int  # most draft tokens allowed (the request's gamma, its remaining budget); also Lookahead's nodes
    lookahead_gain: float | None = None  # expected accepted tokens of a Lookahead step; None: not an option
    tree_alpha: float | None = None  # acceptance estimate of a token tree's depth; None: not an option
    tree_width: int = 3  # tokens a tree tries where the draft is unsure (its siblings: width - 1)
    tree_chains: int = 1  # draft chains a tree grows (draft lanes per depth)
    ngram: int = 0  # tokens an n-gram draft proposes now, within its own cap (0: no match, not an option)
    # S(1..ngram): the chance that the proposal's first j tokens are accepted (calid.decoding.ngram.Copy)
    ngram_survival: tuple[float, ...] = ()
    draft_setup_s: float = 0.0  # the draft model's catch-up before it can draft for this request (tokens it has
    # not seen x its prefill cost per token): paid by this step if the request picks a chain or a tree
    remaining: int | None = None  # tokens the request may still produce (None: no known end): its rank in the
    # batch's cost to go

    @classmethod
    def of_copy(cls, copy, survival: list[float] | None = None, **rest) -> "PlanInput":
        """A request's input with ``copy`` (a calid.decoding.ngram.Copy) as its n-gram option, its survival
        ``survival`` (default: Laplace's, ``Copy.survival``)."""
        return cls(ngram=len(copy.tokens), ngram_survival=tuple(copy.survival() if survival is None else survival),
                   **rest)

    def options(self, drafts: bool) -> tuple[Choice, ...]:
        """The choices open to this request (``drafts``: a draft model's cost is known): its depths on
        DEPTH_GRID and its deepest."""
        return _options(self.ngram, self.cap if drafts else 0, drafts and self.tree_alpha is not None,
                        self.cap if self.lookahead_gain is not None else 0)

    def tokens(self, c: Choice) -> float:
        """Tokens this choice yields on average: the target's one and each draft token's chance of holding
        (a chain's or a tree's (1 - a^(g+1)) / (1 - a), a copy's 1 + S(1) + ... + S(g), Lookahead's 1 + its gain,
        at most 1 + its nodes)."""
        if c.mode == "ngram":  # a planning step asks this of every length of the copy: sums kept, not redone
            sums = self._copy_tokens
            return sums[min(c.gamma, len(sums) - 1)]
        return 1.0 + sum(self.survival(c))

    @functools.cached_property
    def _copy_tokens(self) -> list[float]:
        """1 + S(1) + ... + S(g) for g = 0 .. the copy's length."""
        return list(itertools.accumulate(self.ngram_survival, initial=1.0))

    def survival(self, c: Choice) -> tuple[float, ...]:
        """S(1..g): the chance that the choice's first j draft tokens hold (empty for ar). A chain's from its
        estimate (n-gram: the copy's; draft chain or tree: a^j); a Lookahead step's, of which only a mean is
        known, as if its tokens held with one chance each, the one that gives that mean over its nodes."""
        if c.mode == "ngram":
            return self.ngram_survival[: c.gamma]
        a = {"speculative": self.alpha, "tree": self.tree_alpha}.get(c.mode)
        if c.mode == "lookahead" and self.lookahead_gain is not None:
            a = _per_token(self.lookahead_gain, c.gamma)
        return () if a is None else _powers(a, c.gamma)

    def verified(self, c: Choice) -> int:
        """Tokens the target's forward takes for this choice."""
        if c.mode == "tree":
            return 1 + c.gamma * self.tree_chains + self.tree_width - 1
        return 1 + c.gamma

    def lanes(self, c: Choice) -> int:
        """Draft lanes per depth, down to ``c.gamma``."""
        return 1 if c.mode == "speculative" else self.tree_chains if c.mode == "tree" else 0

    def setup(self, c: Choice) -> float:
        """Seconds of draft catch-up this choice costs before its draft steps."""
        return self.draft_setup_s if self.lanes(c) else 0.0


@functools.lru_cache(maxsize=4096)
def _options(ngram: int, chain: int, tree: bool, lookahead: int) -> tuple[Choice, ...]:
    """ar, n-gram chains to ``ngram`` deep, draft chains (and trees) to ``chain`` deep, a Lookahead step of
    ``lookahead`` nodes: built once per shape rather than every step (some twenty Choice objects a request)."""
    out = [AR] + [Choice("ngram", g) for g in _depths(ngram)]  # the proposal is capped already
    depths = _depths(chain)
    out += [Choice("speculative", g) for g in depths]
    if tree:
        out += [Choice("tree", g) for g in depths]
    if lookahead > 0:
        out.append(Choice("lookahead", lookahead))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _depths(deepest: int) -> tuple[int, ...]:
    """The draft depths priced up to ``deepest``: DEPTH_GRID's, then ``deepest`` itself."""
    return tuple(g for g in DEPTH_GRID if g < deepest) + ((deepest,) if deepest > 0 else ())


@functools.lru_cache(maxsize=4096)
def _powers(a: float, depth: int) -> tuple[float, ...]:
    """a, a^2, ..., a^depth: a chain's survival where each token holds with chance a."""
    return tuple(a ** j for j in range(1, depth + 1))


@functools.lru_cache(maxsize=1024)
def _per_token(mean: float, depth: int) -> float:
    """The chance a with a + a^2 + ... + a^depth = ``mean`` (bisection; 1.0 where ``mean`` >= ``depth``)."""
    if mean >= depth:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** j for j in range(1, depth + 1)) < mean else (lo, mid)
    return (lo + hi) / 2


def _levelled(lengths: list[int], verify, level: int) -> float:
    """Seconds of a forward over sequences of these token counts (none empty) where the runner pads each shorter
    than ``level`` up to it (calid.runtime.seq_input.SeqInput.pad): one slice of ``level`` tokens of every
    sequence, then each longer sequence's remaining tokens as a slice of its own."""
    return verify(level * len(lengths)) + sum(verify(x - level) for x in lengths if x > level)


def batch_level(lengths: list[int], verify) -> int:
    """The level to pad a forward's shorter sequences to (the module's notes: slices): of the sequences' own
    lengths, the one that prices it lowest; the shortest (no padding) where that is as cheap. 0: no sequences."""
    lengths = [x for x in lengths if x > 0]
    return min(sorted(set(lengths)), key=lambda level: _levelled(lengths, verify, level)) if lengths else 0


def split_cost(lengths: list[int], verify) -> float:
    """Seconds of a forward over sequences of these token counts on a runtime that splits a batch into slices,
    its shorter sequences padded to the best level (batch_level; see the module's notes)."""
    lengths = [x for x in lengths if x > 0]
    return _levelled(lengths, verify, batch_level(lengths, verify)) if lengths else 0.0


class _Slices:
    """A fixed set of sequences priced by split_cost, with the price of one more sequence of any length: O(levels),
    the distinct lengths among them."""

    def __init__(self, lengths: Counter, verify):
        self.lengths = {h: n for h, n in lengths.items() if n > 0}
        self.verify = verify
        self.count = sum(self.lengths.values())
        # per level: the slices above it (each longer sequence's rest)
        self.above = {level: sum(n * verify(h - level) for h, n in self.lengths.items() if h > level)
                      for level in self.lengths}

    def price(self, extra: int = 0) -> float:
        """Seconds of the forward with one more sequence of ``extra`` tokens (0: none), at the best level."""
        if not self.count:
            return self.verify(extra)
        n = self.count + (extra > 0)
        best = min(self.verify(level * n) + above + (self.verify(extra - level) if extra > level else 0.0)
                   for level, above in self.above.items())
        if extra > 0 and extra not in self.above:  # the new sequence's own length as the level
            best = min(best, self.verify(extra * n) + sum(k * self.verify(h - extra)
                                                           for h, k in self.lengths.items() if h > extra))
        return best


class _CostToGo:
    """Seconds plain steps would take to finish requests with ``s_i`` tokens left each (the module's notes):
    sum_k s_(k) x weights[k], ``s`` sorted longest first, ``weights[k]`` what the (k+1)-th request adds to a plain
    step. Tokens are counted from the fewest any request had left at the start (the same constant off every
    ``s``: the savings are differences, compared to the digit)."""

    def __init__(self, weights: list[float], left: list[float]):
        self.weights = weights
        self.offset = min(left, default=0.0)
        self.start = self(left)

    def __call__(self, s: list[float]) -> float:
        return sum((x - self.offset) * w for x, w in zip(sorted(s, reverse=True), self.weights))

    def of_one(self, others: list[float]) -> Callable[[float], float]:
        """The cost to go as a function of one request's tokens left, the ``others``' fixed: O(log n) a call."""
        o, w = [x - self.offset for x in sorted(others, reverse=True)], self.weights
        before, after = [0.0], [0.0] * (len(o) + 1)  # others ahead of it keep their rank, the rest move down one
        for k, x in enumerate(o):
            before.append(before[-1] + x * w[k])
        for k in range(len(o) - 1, -1, -1):
            after[k] = after[k + 1] + o[k] * w[k + 1]
        desc = [-x for x in o]

        def cost(x: float) -> float:
            x -= self.offset
            p = bisect.bisect_left(desc, -x)  # others with more tokens left
            return before[p] + x * w[p] + after[p]
        return cost


@functools.lru_cache(maxsize=4096)
def _outcomes(left: float, survival: tuple[float, ...]) -> tuple[tuple[float, float], ...]:
    """A chain's tokens left after the step, with their chances: left - 1 - j where exactly j of its tokens hold,
    S(j) - S(j+1) (S(0) = 1; all g hold with chance S(g)). A deep chain's partial outcomes (some but not all of its
    tokens hold) are merged into SPREAD_ATOMS - 2 groups of about equal chance, each at its mean: the sweep's time
    grows with the outcomes (12 requests with 32-token copies, 2-core CPU: 11 ms a plan merged, 13 ms not)."""
    s = (1.0,) + tuple(survival) + (0.0,)
    out = [(max(0.0, left - 1 - j), s[j] - s[j + 1]) for j in range(len(s) - 1) if s[j] > s[j + 1]]
    if len(out) <= SPREAD_ATOMS:
        return tuple(out)
    middle, groups = out[1:-1], SPREAD_ATOMS - 2
    mass = sum(p for _, p in middle)
    merged, x, p, done = [], 0.0, 0.0, 0.0
    for k, (v, q) in enumerate(middle, 1):
        x, p = x + v * q, p + q
        if k == len(middle) or done + p >= mass * (len(merged) + 1) / groups * (1 - 1e-9):
            merged.append((x / p, p))
            x, p, done = 0.0, 0.0, done + p
    return tuple(out[:1] + merged + out[-1:])


def _drop(q: list[float], p: float) -> None:
    """Take out of q (the distribution of how many of some requests are still decoding) one request that was with
    chance p, in place, leaving q's last entry free; forwards where p <= 1/2 and backwards otherwise, so rounding
    errors shrink."""
    m = len(q) - 1
    if p <= 0.5:
        prev = 0.0
        for k in range(m):
            prev = q[k] = max(0.0, (q[k] - p * prev) / (1.0 - p))
    else:
        nxt, here = 0.0, q[m]  # without it, none is at m; here: q[k] before it is overwritten
        for k in range(m, 0, -1):
            here, q[k - 1] = q[k - 1], max(0.0, (here - (1.0 - p) * nxt) / p)
            nxt = q[k - 1]
    q[m] = 0.0


def _put(q: list[float], p: float) -> None:
    """Add to q a request still decoding with chance p (the last entry must be free), in place."""
    for k in range(len(q) - 1, 0, -1):
        q[k] = q[k] * (1.0 - p) + q[k - 1] * p
    q[0] *= 1.0 - p


class _Spread:
    """The expected cost to go of requests whose tokens left after this step are uncertain (a chain's tokens hold
    or break), beside others' that are taken as certain.

    C(s) = sum_k s_(k) w_k is also the integral over t of W(N(t)), N(t) the requests with more than t tokens left
    and W(m) = w_1 + ... + w_m a plain step's cost with m of them: each token position is a plain step of the
    requests that still have it to make. Requests' chains hold or break independently, so E[C] integrates
    E[W(N(t))], N(t) a fixed count plus a Poisson-binomial one, swept over t with one request's chance changing at
    a time. The request furthest behind sets the steps left; where some copies hold and others break, it is behind
    by more than its mean says (4 requests 48 tokens from the end, each copy holding 16 tokens or none at even
    odds: a plain step's cost for ~47 more steps with chance 15/16, not for 39.5): C(mean) overstates the saving.

    ``marginal``: also the cost to go as a function of one more request's tokens left (``value``)."""

    def __init__(self, certain: list[float], chains: list[tuple[tuple[float, float], ...]], weights: list[float],
                 offset: float, marginal: bool = False):
        events = sorted([(x, -1, 1.0) for x in certain] + [(x, j, p) for j, o in enumerate(chains) for x, p in o
                                                             if p > 0.0])  # an outcome that cannot happen: none
        cum = [0.0]
        for w in weights:
            cum.append(cum[-1] + w)
        # fixed: requests surely still decoding at t; q: how many of the chains whose chance is strictly between
        # 0 and 1 at t are (a chain joins q at its first outcome and leaves at its last)
        chance, q, fixed = [1.0] * len(chains), [1.0], len(certain) + len(chains)
        state = [0] * len(chains)  # a chain is fixed (0), in q (1), or done (2: its chance is spent)
        self.area, t0 = -offset * cum[len(weights)], 0.0
        self.knots: list[float] = []
        self.base: list[float] = []
        self.slopes: list[float] = []
        for t, j, dp in events + [(float("inf"), -2, 0.0)]:
            if t > t0:
                if marginal:
                    self.knots.append(t0)
                    self.base.append(self.base[-1] + (t0 - self.knots[-2]) * self.slopes[-1] if self.slopes else 0.0)
                    self.slopes.append(sum(x * weights[fixed + r] for r, x in enumerate(q) if x))
                if t == float("inf"):
                    break
                self.area += (t - t0) * sum(x * cum[fixed + r] for r, x in enumerate(q) if x)
                t0 = t
            if j == -1:
                fixed -= 1
            elif j >= 0 and state[j] < 2:  # (outcomes past a spent chance: rounding, nothing left to move)
                if state[j] == 0:
                    state[j] = 1
                    fixed -= 1
                    q.append(0.0)
                else:
                    _drop(q, chance[j])
                chance[j] -= dp
                if chance[j] > 1e-12:
                    _put(q, chance[j])
                else:
                    state[j] = 2
                    q.pop()

    def value(self, x: float) -> float:
        """Expected cost to go with one more request that has ``x`` tokens left (``marginal`` only)."""
        k = bisect.bisect_right(self.knots, x) - 1
        return self.area + self.base[k] + (x - self.knots[k]) * self.slopes[k]


class _Step:
    """A step's totals under a plan (expected tokens, verified tokens, draft lanes by depth, each request's tokens
    left after it), kept up to date as single requests change their choice, with the costs memoised by size
    (whole tokens and lanes). ``sliced``: the target splits a batch into slices (split_cost), so a verification is
    priced from every sequence's length, not from their total; the ``fixed_tokens`` other requests count one token
    each, in this step and the plain steps after it. ``spread``: a chain's tokens are priced over what it may yield
    (_Spread), not at its mean (one request: the same), where its request has a known end: with none, the cost to
    go stands for tokens per second, which a chain's mean sets."""

    def __init__(self, reqs: list[PlanInput], verify: CostTable, draft_step: CostTable, fixed_tokens: int,
                 plan: list[Choice], sliced: bool = False, spread: bool = True, like: "_Step | None" = None):
        self.reqs, self.fixed = reqs, fixed_tokens
        self._verify, self._draft_step = verify, draft_step
        self.plan, self.verified, self.setup = list(plan), fixed_tokens, 0.0
        self.lengths: Counter | None = Counter({1: fixed_tokens}) if sliced else None
        self.lanes = [0] * max([c.gamma for c in plan] + [r.cap for r in reqs] + [0])
        if like is None:
            self._verify_memo: dict[int, float] = {}
            self._draft_memo: dict[int, float] = {0: 0.0}
            known = [r.remaining for r in reqs if r.remaining is not None]
            self.left = [float(max(known, default=0) + NO_END if r.remaining is None else r.remaining) for r in reqs]
            self.togo = _CostToGo(self._row_costs(len(reqs)), self.left)
        else:  # the same requests and costs under another plan: the costs memoised, the tokens left and the cost to
            # go are shared (a planning step prices some twenty plans: built anew, they took 1.3 ms of a 30-80 ms step)
            self._verify_memo, self._draft_memo = like._verify_memo, like._draft_memo
            self.left, self.togo = like.left, like.togo
        self.after = list(self.left)
        self.spread = spread and len(reqs) > 1
        # request -> its tokens left after the step, by chance (chains of requests with a known end)
        self.chains: dict[int, tuple[tuple[float, float], ...]] = {}
        for i, c in enumerate(plan):
            self._add(i, c, +1)

    def _row_costs(self, n: int) -> list[float]:
        """What each of n requests adds to a plain step beside the fixed ones, rising with n (timings are noisy:
        4 rows measured cheaper than 3 must not make a row worth less than nothing)."""
        top, out = self.verify(self.fixed), []
        for k in range(1, n + 1):
            cost = max(top, self.verify(self.fixed + k))
            out.append(cost - top)
            top = cost
        return out

    def verify(self, tokens: int) -> float:
        if tokens not in self._verify_memo:
            self._verify_memo[tokens] = self._verify(tokens)
        return self._verify_memo[tokens]

    def _verification(self) -> Callable[[int], float]:
        """Seconds of the target's forward with one more sequence of the given tokens (0: none) beside the
        choices now in the plan."""
        if self.lengths is None:
            return lambda extra: self.verify(self.verified + extra)
        return _Slices(self.lengths, self.verify).price

    def draft(self, lanes: int) -> float:
        if lanes not in self._draft_memo:
            self._draft_memo[lanes] = self._draft_step(lanes)
        return self._draft_memo[lanes]

    def _add(self, i: int, c: Choice, sign: int) -> None:
        r = self.reqs[i]
        self.after[i] = max(0.0, self.left[i] - r.tokens(c)) if sign > 0 else self.left[i]
        self.chains.pop(i, None)
        if sign > 0 and (outcomes := self._outcomes_of(i, c)):
            self.chains[i] = outcomes
        self.verified += sign * r.verified(c)
        self.setup += sign * r.setup(c)
        if self.lengths is not None:
            self.lengths[r.verified(c)] += sign
        if k := r.lanes(c):
            for d in range(c.gamma):
                self.lanes[d] += sign * k

    def _outcomes_of(self, i: int, c: Choice) -> tuple[tuple[float, float], ...]:
        """Request i's tokens left after choice ``c``, by chance, where the step prices spread and the request has
        a known end; empty where the choice's yield is priced at its mean (ar, no spread, no known end)."""
        r = self.reqs[i]
        if not self.spread or r.remaining is None or not (survival := r.survival(c)):
            return ()
        return _outcomes(self.left[i], survival)

    def seconds(self) -> float:
        """Expected seconds of the step under the plan now held."""
        return self.setup + sum(self.draft(n) for n in self.lanes) + self._verification()(0)

    def forecast(self) -> tuple[float, float]:
        """(plain decoding seconds the step is expected to save, the seconds it is expected to take)."""
        return self.togo.start - self._expected_cost(), self.seconds()

    def rate(self) -> float:
        """Plain decoding seconds the step saves per second it takes (the module's notes: cost to go)."""
        seconds = self.seconds()
        return (self.togo.start - self._expected_cost()) / seconds if seconds > 0 else 0.0

    def _expected_cost(self) -> float:
        if not self.chains:
            return self.togo(self.after)
        certain = [x for j, x in enumerate(self.after) if j not in self.chains]
        return _Spread(certain, list(self.chains.values()), self.togo.weights, self.togo.offset).area

    def _value_of_one(self, i: int) -> Callable[[float], float]:
        """The expected cost to go as a function of request i's tokens left, the others' choices fixed."""
        others = self.after[:i] + self.after[i + 1:]
        if not self.chains:
            return self.togo.of_one(others)
        certain = [x for j, x in enumerate(self.after) if j != i and j not in self.chains]
        return _Spread(certain, list(self.chains.values()), self.togo.weights, self.togo.offset, marginal=True).value

    def _expected_saving(self, i: int, options: list[Choice]) -> list[float]:
        """Each option's saving, in the options' order: the cost to go now less its expected cost to go after the
        step (a chain's over the tokens it may yield, where the step prices spread)."""
        r, value, left, start = self.reqs[i], self._value_of_one(i), self.left[i], self.togo.start
        out = []
        for c in options:
            if outcomes := self._outcomes_of(i, c):
                after = sum(p * value(x) for x, p in outcomes)
            else:
                after = value(max(0.0, left - r.tokens(c)))
            out.append(start - after)
        return out

    def choose(self, i: int, options: list[Choice]) -> float:
        """Give request ``i`` its best option with the others' choices fixed; return the step's rate. Every
        option costs O(1) after O(depth) prefix sums of what more draft lanes cost at each depth."""
        r = self.reqs[i]
        self._add(i, self.plan[i], -1)
        base = self.setup + sum(self.draft(n) for n in self.lanes)
        verification = self._verification()
        saving = self._expected_saving(i, options)
        extra: dict[int, list[float]] = {}  # lanes per depth -> extra draft time down to each depth
        held = self.plan[i]
        best, choice = -1.0, held
        for c, saved in zip(options, saving):
            k = r.lanes(c)
            if k and k not in extra:
                acc, sums = 0.0, [0.0]
                for n in self.lanes:
                    acc += self.draft(n + k) - self.draft(n)
                    sums.append(acc)
                extra[k] = sums
            seconds = base + r.setup(c) + (extra[k][c.gamma] if k else 0.0) + verification(r.verified(c))
            rate = saved / seconds if seconds > 0 else 0.0
            if rate > best * (1 + 1e-9) or (rate >= best and c == held):
                best, choice = rate, c
        self.plan[i] = choice
        self._add(i, choice, +1)
        return best


def step_rate(plan: list[Choice], reqs: list[PlanInput], verify: CostTable, draft_step: CostTable,
              fixed_tokens: int = 0, sliced: bool = False, spread: bool = True) -> float:
    """Plain decoding seconds a step under ``plan`` is expected to save per second it takes (the module's notes:
    cost to go; one request: its expected tokens per second x a plain step's seconds). ``fixed_tokens``: other
    work in the forward, one token per other request; ``sliced``: the target splits a batch into slices, see
    split_cost; ``spread``: chains priced over what they may yield (_Spread), else at their means."""
    return _Step(reqs, verify, draft_step, fixed_tokens, plan, sliced, spread).rate()


def step_saving(plan: list[Choice], reqs: list[PlanInput], verify: CostTable, draft_step: CostTable,
                fixed_tokens: int = 0, sliced: bool = False) -> tuple[float, float]:
    """(plain decoding seconds a step under ``plan`` is expected to save, the seconds it is expected to take): the
    two sides of step_rate, for the guard to check against what the step did (GroupPlan.saved)."""
    return _Step(reqs, verify, draft_step, fixed_tokens, plan, sliced).forecast()


@dataclass(frozen=True)
class GroupPlan:
    """One replica's auto requests planned (plan_group): each one's choice, the step's (saving, seconds) under it
    (step_saving) and run plain, and the plain step's terms, which price what the step then did (``saved``)."""

    chosen: list[Choice]
    forecast: tuple[float, float]
    plain: tuple[float, float]
    _togo: _CostToGo
    _left: list[float]  # each request's tokens left before the step

    def saved(self, produced: list[int]) -> float:
        """Plain decoding seconds the step saved where request i got ``produced[i]`` tokens: the batch's cost to go
        before it less after it, in the terms of the forecast. A token of a request already ahead of the others is
        worth its row of a later plain step; one of the request furthest behind, a whole step."""
        return self._togo.start - self._togo([max(0.0, x - n) for x, n in zip(self._left, produced)])


def plan_group(reqs: list[PlanInput], verify: CostTable, draft_step: CostTable, fixed_tokens: int = 0,
               sliced: bool = False) -> GroupPlan:
    """plan_steps with what the step guard needs of the same terms: one plain step's costs and cost to go are
    priced once and shared (each priced anew, a step built four of them: 0.08 ms of a 1.3 ms step beside the
    forward, one request on a 2-core CPU)."""
    if len(reqs) == 1 and verify.known and not fixed_tokens:
        return _plan_alone(reqs[0], verify, draft_step)
    base = _Step(reqs, verify, draft_step, fixed_tokens, [AR] * len(reqs), sliced)
    plain = base.forecast()
    if len(reqs) == 1 and verify.known:  # plan_steps' own way for one request, on the plain step itself (its
        step = base  # cost to go and tokens left, which ``saved`` reads, stay as they were)
        step.choose(0, reqs[0].options(draft_step.known))
        chosen = step.plan
    else:
        chosen = plan_steps(reqs, verify, draft_step, fixed_tokens, sliced=sliced)
        step = None if all(c == AR for c in chosen) else _Step(reqs, verify, draft_step, fixed_tokens, chosen, sliced,
                                                               like=base)
    forecast = plain if step is None else step.forecast()
    return GroupPlan(chosen, forecast, plain, base.togo, base.left)


def _plan_alone(r: PlanInput, verify: CostTable, draft_step: CostTable) -> GroupPlan:
    """plan_group for a request alone in its forward, priced directly: each token it yields spares a whole plain
    step (its cost to go is its tokens left x one row), and a choice's seconds are its draft steps and one
    verification of its own tokens. The same plan and numbers as the general pricing (_Step), which a step at one
    request spent 0.16 ms of its 1.0 beside the forward on (Qwen 1.5B, HumanEval, 2-core CPU, in process)."""
    row, left = verify(1), float(NO_END if r.remaining is None else r.remaining)
    best, choice, terms = -1.0, AR, (0.0, 0.0)
    for c in r.options(draft_step.known):  # ar first: ties go to it and to shallower choices
        lanes = r.lanes(c)
        seconds = verify(r.verified(c)) + (r.setup(c) + c.gamma * draft_step(lanes) if lanes else 0.0)
        saving = row * min(left, r.tokens(c))
        rate = saving / seconds if seconds > 0 else 0.0
        if rate > best * (1 + 1e-9):
            best, choice, terms = rate, c, (saving, seconds)
    return GroupPlan([choice], terms, (row * min(left, 1.0), row), _CostToGo([row], [left]), [left])


def plan_steps(reqs: list[PlanInput], verify: CostTable, draft_step: CostTable, fixed_tokens: int = 0,
               passes: int = 2, sliced: bool = False) -> list[Choice]:
    """Per request the Choice maximising ``step_rate``. Starts from the best plan that gives every request the
    same choice (a batched draft step costs about as much for one lane as for many, so drafting often pays
    only when many requests draft together), then improves one request at a time. A busy or slow-to-verify
    target drafts nothing; an idle one with good acceptance drafts long. Draft chains and trees are options
    only with a draft cost known (a draft model), trees and Lookahead only where their estimates are given.

    Chains are first priced at their means, which is cheap and values a plan at least as high as its spread does
    wherever each row adds no more to a plain step than the row before (the cost to go is then convex); only a plan
    that drafts is searched again over what its chains may yield, and of the uniform plans only those whose price at
    the means beats the best found so far."""
    if not verify.known or not reqs:
        return [AR] * len(reqs)
    if len(reqs) == 1:  # the uniform plans are the request's own options, and one choose prices each in O(1): the
        # search below would build a step per option first (a millisecond of a 30 ms step at one request)
        step = _Step(reqs, verify, draft_step, fixed_tokens, [AR], sliced, spread=False)
        step.choose(0, reqs[0].options(draft_step.known))
        return step.plan
    problem = _Problem(reqs, verify, draft_step, fixed_tokens, sliced)
    plan = _search(problem, passes, spread=False)
    if len(reqs) == 1 or all(c == AR for c in plan):
        return plan
    return _search(problem, passes, spread=True)


@dataclass(frozen=True)
class _Problem:
    """One step's planning problem, with what both searches share: every request's options, the plans that give
    every request the same kind of choice, and those plans' rates at the chains' means, best first (an upper
    bound on their rates over what the chains may yield)."""

    reqs: list[PlanInput]
    verify: CostTable
    draft_step: CostTable
    fixed_tokens: int = 0
    sliced: bool = False
    options: list[list[Choice]] = field(init=False)
    uniform: list[list[Choice]] = field(init=False)
    at_means: list[tuple[float, int]] = field(init=False)  # (rate at the means, index into uniform)

    def __post_init__(self):
        object.__setattr__(self, "_base", _Step(self.reqs, self.verify, self.draft_step, self.fixed_tokens,
                                                [AR] * len(self.reqs), self.sliced))
        options = [r.options(self.draft_step.known) for r in self.reqs]
        offered = [set(opts) for opts in options]
        kinds = sorted(set().union(*offered), key=_order)
        uniform = [[c if c in offer else _nearest(c, opts) for opts, offer in zip(options, offered)] for c in kinds]
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "uniform", uniform)
        object.__setattr__(self, "at_means", sorted(((self.rate(p, False), k) for k, p in enumerate(uniform)),
                                                    key=lambda x: (-x[0], x[1])))

    def rate(self, plan: list[Choice], spread: bool) -> float:
        return self.step(plan, spread).rate()

    def step(self, plan: list[Choice], spread: bool) -> _Step:
        return _Step(self.reqs, self.verify, self.draft_step, self.fixed_tokens, plan, self.sliced, spread,
                     like=self._base)


def _search(problem: _Problem, passes: int, spread: bool) -> list[Choice]:
    """The best uniform plan, then ``passes`` rounds of improving one request at a time."""
    best, plan = -1.0, problem.uniform[0]
    for bound, k in problem.at_means:  # spread pricing only where the mean could beat the best so far
        if bound <= best:
            break
        rate = problem.rate(problem.uniform[k], spread) if spread else bound
        if rate > best:
            best, plan = rate, problem.uniform[k]
    step = problem.step(plan, spread)
    for _ in range(passes):
        before = list(step.plan)
        for i, options in enumerate(problem.options):
            step.choose(i, options)
        if step.plan == before:
            break
    return step.plan


def _order(c: Choice) -> tuple[int, int]:
    """Ties go to the simplest choice: ar, then n-gram and draft chains, trees and Lookahead, shallow before
    deep."""
    return ("ar", "ngram", "speculative", "tree", "lookahead").index(c.mode), c.gamma


def _nearest(c: Choice, options: list[Choice]) -> Choice:
    """The same kind of choice as deep as ``options`` allow, else ar."""
    same = [o for o in options if o.mode == c.mode and o.gamma <= c.gamma]
    return max(same, key=lambda o: o.gamma, default=AR)


@dataclass(frozen=True)
class Forecast:
    """What the planner expects of a step: to save ``saving`` seconds of plain decoding (the batch's cost to go:
    step_saving) in ``seconds``, where the same step run plain would save ``plain_saving`` in ``plain_seconds``."""

    saving: float
    seconds: float
    plain_saving: float
    plain_seconds: float

    @classmethod
    def plain(cls, saving: float, seconds: float) -> "Forecast":
        return cls(saving, seconds, saving, seconds)


@dataclass
class _Held:
    """How steps of one kind went against their forecasts: decayed sums of seconds taken and forecast, of plain
    decoding seconds saved and forecast (GroupPlan.saved, step_saving), and of tokens produced (for ms per token)."""

    seconds: float = 0.0
    forecast_s: float = 0.0
    saved: float = 0.0
    forecast_saved: float = 0.0
    tokens: float = 0.0
    samples: int = 0

    def observe(self, seconds: float, tokens: int, saved: float, forecast: Forecast) -> None:
        d = GUARD_DECAY
        self.seconds, self.tokens = d * self.seconds + seconds, d * self.tokens + tokens
        self.saved, self.forecast_saved = d * self.saved + saved, d * self.forecast_saved + forecast.saving
        self.forecast_s = d * self.forecast_s + forecast.seconds
        self.samples += 1

    @property
    def per_token(self) -> float:
        return self.seconds / self.tokens

    @property
    def slower(self) -> float:
        """Seconds taken per second forecast (1.0 until forecasts are known)."""
        return self.seconds / self.forecast_s if self.forecast_s > 0 else 1.0

    @property
    def yielded(self) -> float:
        """Seconds saved per second of saving forecast (1.0 until forecasts are known)."""
        return self.saved / self.forecast_saved if self.forecast_saved > 0 else 1.0


def guard_bucket(requests: int) -> int:
    """Steps are compared with steps of about as many requests: exact up to 8, then powers of two."""
    return requests if requests <= 8 else 1 << (requests - 1).bit_length()


def draft_depth(extra_tokens: float) -> int:
    """A drafting plan's class (1, 2, 3) by the tokens it expects beyond a plain step's (one per request)."""
    return next(i for i, edge in enumerate(DEPTH_EDGES, 1) if extra_tokens < edge)


ANY_DEPTH = -1  # every drafting step of a batch bucket: what judges a depth with too few steps of its own


class StepGuard:
    """Whether a step may draft as planned: its forecast, corrected by how forecasts of its kind held, against a
    plain step's, corrected the same way.

    Steps are measured in the planner's own terms: plain decoding seconds saved (the batch's cost to go before
    the step less after it, GroupPlan.saved) per second taken. Counting tokens instead let a burst lose: at 4 requests
    three copied 50 tokens each ahead of a fourth, 30 ms per token against a plain step's 34, and the fourth then
    decoded its last 58 tokens alone at 75 ms each (Qwen 1.5B, 2-core CPU: auto 0.87x ar); valued as the rows of
    later plain steps they spare, those tokens saved less than the copies cost. A drafting step's forecast
    (``Forecast``) is scaled by what steps of its batch size and depth measurably did against theirs: seconds
    taken per second forecast (transport, planning, a verification dearer than its table) and seconds saved per
    second of saving forecast (a copy that breaks sooner than its survival said, tokens that land ahead of the
    others); a plain step's the same way. The step drafts only where the corrected forecast saves at least
    GUARD_MARGIN more per second. So a strong forecast still drafts where weak ones of the same depth lost (a
    refactor's long copy beside a summary's shaky ones), and forecasts that do not hold stop drafting. A depth
    with fewer than GUARD_MIN steps of its own is judged by all drafting steps of its size."""

    def __init__(self):
        self._kinds: dict[tuple[int, int], _Held] = {}  # (batch bucket, depth; 0: plain, ANY_DEPTH) -> how they went
        self._asked: dict[tuple[int, int], int] = {}
        self._unplanned: dict[int, int] = {}  # batch bucket -> steps plans() turned away
        self.overruled = 0  # planned drafting steps run plain
        self.unplanned = 0  # steps run plain without planning (plans)

    def plans(self, requests: int) -> bool:
        """Is a step of ``requests`` requests worth planning? Not where this batch size's drafting steps measurably
        saved no more per second than its plain steps did, by the margin: the guard would run most plans plain,
        and planning only costs (16 requests, Qwen 1.5B on a 2-core CPU: 5-11 ms of a 330 ms plain step, where
        drafting steps took 27.7 ms a token against plain's 28.2). The steps it answers no to run plain, untimed;
        one in GUARD_EXPLORE is planned all the same, so that a strong forecast still gets its chance and the
        measures stay current."""
        b = guard_bucket(requests)
        plain, drafted = self._kinds.get((b, 0)), self._kinds.get((b, ANY_DEPTH))
        if plain is None or drafted is None or min(plain.samples, drafted.samples) < GUARD_MIN:
            return True
        if drafted.saved * plain.seconds > plain.saved * drafted.seconds * (1 + GUARD_MARGIN):
            return True
        k = self._unplanned[b] = self._unplanned.get(b, 0) + 1
        self.unplanned += k % GUARD_EXPLORE != 0
        return k % GUARD_EXPLORE == 0

    def allow(self, requests: int, depth: int, forecast: Forecast) -> bool:
        """A step of ``requests`` requests whose plan drafts ``depth`` deep (``draft_depth``) as ``forecast``:
        may it?"""
        b = guard_bucket(requests)
        k = self._asked[b, depth] = self._asked.get((b, depth), 0) + 1
        plain, drafted = self._kinds.get((b, 0)), self._kinds.get((b, depth))
        if drafted is None or drafted.samples < GUARD_MIN:
            drafted = self._kinds.get((b, ANY_DEPTH))
        if plain is None or plain.samples < GUARD_MIN:
            ok = k % GUARD_PROBE != 0
        elif drafted is None or drafted.samples < GUARD_MIN or forecast.seconds <= 0 or forecast.plain_seconds <= 0:
            ok = True
        else:
            drafting = forecast.saving * drafted.yielded / (forecast.seconds * drafted.slower)
            plain_rate = forecast.plain_saving * plain.yielded / (forecast.plain_seconds * plain.slower)
            if drafting < plain_rate * (1 + GUARD_MARGIN):  # a tie is plain's
                ok = k % GUARD_EXPLORE == 0
            else:
                ok = k % GUARD_EXPLORE != 0
        self.overruled += not ok
        return ok

    def observe(self, requests: int, depth: int, seconds: float, tokens: int, saved: float,
                forecast: Forecast) -> None:
        """A whole step (planning, draft, verify, transport) that drafted ``depth`` deep (0: a plain step), forecast
        as ``forecast``, took ``seconds``, produced ``tokens`` and saved ``saved`` seconds of plain decoding."""
        if tokens <= 0 or seconds <= 0:
            return
        b = guard_bucket(requests)
        for key in ((b, depth), (b, ANY_DEPTH)) if depth else ((b, 0),):
            self._kinds.setdefault(key, _Held()).observe(seconds, tokens, saved, forecast)

    def summary(self) -> dict[str, float]:
        """Measured milliseconds per output token by batch bucket and kind (for stats and metrics)."""
        return {f"{DEPTH_NAMES[d]}@{b}": round(1000 * r.per_token, 2) for (b, d), r in sorted(self._kinds.items())
                if d != ANY_DEPTH}
