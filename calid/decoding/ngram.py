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
