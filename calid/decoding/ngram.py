"""N-gram drafts (prompt lookup): model-free draft chains copied from a request's own tokens.

Work grounded in its input (edits, refactors, summaries that quote, answers from a
retrieved passage) repeats spans of the prompt or of what was already written. An
n-gram draft finds the last ``n`` tokens of the sequence earlier in the same
sequence and proposes what followed them there. It costs no model time: only the
target's verification forward, which accepts a prefix of the chain exactly as it
accepts a draft model's greedy chain (lossless; sampled requests verify it as a
one-hot draft distribution).

Terms:
  match     an earlier occurrence of the sequence's last ``n`` tokens (the
            longest ``n`` in [min_n, max_n] that occurs), the most recent one;
  proposal  the tokens that followed the match, at most ``max_tokens``; empty
            when no suffix of ``min_n`` or more tokens occurred before.

``NgramIndex`` keeps, per n, the last position each n-gram ended at, updated as
tokens are appended (O(max_n) per token), so a proposal costs O(max_n) lookups.
"""
from __future__ import annotations

from dataclasses import dataclass

# longest n-gram chain a step verifies: a copy costs no draft time, only its verification, which the planner prices
# (a draft model's chains stay within the request's gamma); on a 2-core CPU a 33-token verification of Qwen 1.5B
# costs ~15 plain steps against ~11 for 17 tokens, and the grounded workload's copies often run 10-30 tokens
MAX_CHAIN = 32


@dataclass(frozen=True)
class NgramConfig:
    min_n: int = 2  # shortest suffix that counts as a match (one token matches too often to be worth verifying)
    max_n: int = 4  # longest suffix tried first

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")


class NgramIndex:
    """Where each n-gram of one growing sequence last ended, for n in [min_n, max_n].

    ``_last[n][gram]`` is the end (exclusive) of the latest occurrence of ``gram`` *before* the newest one, so
    the sequence's own suffix never matches itself.
    """

    def __init__(self, config: NgramConfig = NgramConfig()):
        self.cfg = config
        self.ids: list[int] = []
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(config.min_n, config.max_n + 1)}
        self._pending: dict[int, tuple[tuple[int, ...], int] | None] = {n: None for n in self._last}

    def extend(self, ids: list[int]) -> None:
        """Bring the index up to ``ids``, which must start with what it has seen (a shorter or different
        sequence rebuilds it: a rollback is rare and a rebuild costs O(len))."""
        seen = len(self.ids)
        if len(ids) < seen or ids[max(0, seen - 1): seen] != self.ids[max(0, seen - 1):]:
            self.__init__(self.cfg)
            seen = 0
        for token in ids[seen:]:
            self._push(token)

    def _push(self, token: int) -> None:
        self.ids.append(token)
        end = len(self.ids)
        for n, table in self._last.items():
            if end < n:
                continue
            pending = self._pending[n]  # the previous newest n-gram becomes matchable now
            if pending is not None:
                table[pending[0]] = pending[1]
            self._pending[n] = (tuple(self.ids[end - n:]), end)

    def propose(self, max_tokens: int) -> list[int]:
        """Draft tokens that followed the most recent earlier occurrence of the longest matching suffix."""
        if max_tokens <= 0:
            return []
        ids, end = self.ids, len(self.ids)
        for n in range(min(self.cfg.max_n, end), self.cfg.min_n - 1, -1):
            at = self._last[n].get(tuple(ids[end - n:]))
            if at is not None and at < end:
                return ids[at: min(end, at + max_tokens)]
        return []


class CopyRecord:
    """What a request's n-gram proposals would have yielded, learnt without verifying them (shadow drafts).

    The planner sees a proposal every step, whether it drafts it or not. Once the request's committed tokens
    reach the place where a proposal first differs from them, or cover it whole, the proposal is resolved: a
    greedy verification would have accepted exactly the prefix the committed tokens repeat (a sampled one, each
    such token with its probability). Per chain position j, ``trials[j]`` counts the resolved proposals that
    reached j and ``fails[j]`` those whose j-th token differed, both exponentially forgotten, so

        S(j) = prod_{i <= j} (1 - (fails[i] + 2 prior h_i) / (trials[i] + 2 prior))

    is the chance that a proposal's first j tokens all hold, where the prior hazard h_1 is 1/2 and h_i past the
    first is the pooled rate at which copies broke at any position past the first (1/2 with no record). A copy is
    not a per-token coin: a refactor's copies hold for 10-30 tokens and then break at the renamed name, so what
    a chain of g tokens is worth (1 + S(1) + ... + S(g) tokens) is read per position. Since plain steps teach it
    too, a request that stopped drafting still learns when its copies start to hold, without paying a
    verification to find out.
    """

    def __init__(self, longest: int = MAX_CHAIN, decay: float = 0.95, prior: float = 0.5):
        self.longest, self.decay, self.prior = longest, decay, prior
        self.trials = [0.0] * (longest + 1)  # index j: chain position j (1-based); 0 unused
        self.fails = [0.0] * (longest + 1)
        self._pending: list[tuple[int, list[int]]] = []  # (position of the first proposed token, the proposal)

    def propose(self, at: int, chain: list[int]) -> None:
        """The proposal made when the sequence held ``at`` tokens."""
        if chain:
            self._pending.append((at, chain[: self.longest]))

    def resolve(self, ids: list[int]) -> None:
        """Settle the proposals that ``ids`` (the committed tokens) decide."""
        waiting = []
        for at, chain in self._pending:
            if len(ids) < at:  # the sequence was cut back before the proposal: it says nothing
                continue
            known = ids[at: at + len(chain)]
            held = next((i for i, (a, b) in enumerate(zip(chain, known)) if a != b), len(known))
            if held < len(known):
                self._observe(held, failed=True)
            elif len(known) == len(chain):
                self._observe(held, failed=False)
            else:
                waiting.append((at, chain))
        self._pending = waiting

    def _observe(self, held: int, failed: bool) -> None:
        for j in range(1, self.longest + 1):
            self.trials[j] *= self.decay
            self.fails[j] *= self.decay
        reached = held + 1 if failed else held
        for j in range(1, reached + 1):
            self.trials[j] += 1.0
        if failed:
            self.fails[held + 1] += 1.0

    def survival(self, n: int) -> list[float]:
        """S(1), ..., S(n): the chance that the first j tokens of a proposal hold."""
        w = 2 * self.prior
        # past the first token, a position seldom reached leans on how often a copy breaks at any later position
        later = (sum(self.fails[2:]) + self.prior) / (sum(self.trials[2:]) + w)
        out, alive = [], 1.0
        for j in range(1, min(n, self.longest) + 1):
            alive *= 1.0 - (self.fails[j] + w * (0.5 if j == 1 else later)) / (self.trials[j] + w)
            out.append(alive)
        return out
