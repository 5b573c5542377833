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
            longest ``n`` in [min_n, max_n] that occurs): the most recent one,
            or for a ``copy``, of the last CANDIDATES occurrences the one the
            sequence agrees with longest (``agreement``);
  proposal  the tokens that followed the match, at most ``max_tokens``; empty
            when no suffix of ``min_n`` or more tokens occurred before.

``NgramIndex`` keeps, per n, the last CANDIDATES positions each n-gram ended at, updated
as tokens are appended (O(max_n) per token), so a proposal costs O(max_n) lookups, plus
a walk back over the tokens that agree with each candidate, through small edits
(``agreement``, ``Copy.agreed``), which picks the candidate and tells the planner how far
its copy is likely to hold (``Copy.survival``).
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

# longest n-gram chain a step verifies: a copy costs no draft time, only its verification, which the planner prices
# (a draft model's chains stay within the request's gamma); on a 2-core CPU a 33-token verification of Qwen 1.5B
# costs ~15 plain steps against ~11 for 17 tokens, and the grounded workload's copies often run 10-30 tokens
MAX_CHAIN = 32
EDITS = 2  # small edits the agreement walk passes (calid.decoding.ngram.agreement)
EDIT_TOKENS = 4  # the most tokens an edit inserts on either side
RESYNC = 3  # tokens that must agree again past an edit for the walk to go on
RUN_CHUNK = 16  # tokens the agreement walk compares at once (_run_back)
# earlier occurrences of an n-gram a copy chooses among: the most recent one is often a short repeat (a name used
# again) where an older one continues a long passage the sequence is copying (a docstring restated); replayed through
# the planner on 16 HumanEval chat answers of Qwen 1.5B (calid.bench.plan_replay, the calibrated 2-core table),
# choosing by agreement took c1 / c4 from 2.94 / 1.55x to 3.04 / 1.64x ar decoding (2, 4 and 8 candidates alike)
CANDIDATES = 4


@dataclass(frozen=True)
class NgramConfig:
    min_n: int = 2  # shortest suffix that counts as a match (one token matches too often to be worth verifying)
    max_n: int = 4  # longest suffix tried first

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")


class NgramIndex:
    """Where each n-gram of one growing sequence ended, its latest occurrences, for n in [min_n, max_n].

    ``_last[n][gram]`` lists the ends (exclusive) of the latest CANDIDATES occurrences of ``gram`` *before* the
    newest one, most recent first, so the sequence's own suffix never matches itself.
    """

    def __init__(self, config: NgramConfig = NgramConfig()):
        self.cfg = config
        self.ids: list[int] = []
        self._last: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(config.min_n,
                                                                                        config.max_n + 1)}
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
        ids, pendings = self.ids, self._pending
        ids.append(token)
        end = len(ids)
        for n, table in self._last.items():
            if end < n:
                continue
            pending = pendings[n]  # the previous newest n-gram becomes matchable now
            if pending is not None:
                gram, at = pending
                ends = table.get(gram)
                if ends is None:
                    table[gram] = [at]
                else:
                    ends.insert(0, at)
                    if len(ends) > CANDIDATES:
                        ends.pop()
            pendings[n] = (tuple(ids[end - n:]), end)

    def propose(self, max_tokens: int) -> list[int]:
        """Draft tokens that followed the most recent earlier occurrence of the longest matching suffix (without
        the agreement walk of ``copy``)."""
        ends = self._matches() if max_tokens > 0 else []
        return self.ids[ends[0]: min(len(self.ids), ends[0] + max_tokens)] if ends else []

    def copy(self, max_tokens: int, longest_agreement: int = 256) -> Copy:
        """The proposal from the candidate match the sequence agrees with longest (the most recent of equals),
        with how many tokens before it agree (counted back to at most ``longest_agreement``)."""
        ends = self._matches() if max_tokens > 0 else []
        if not ends:
            return Copy([], 0, self.cfg.min_n)
        end = len(self.ids)
        agreed, newer = max((agreement(self.ids, at, end, longest_agreement), -k) for k, at in enumerate(ends))
        at = ends[-newer]
        return Copy(self.ids[at: min(end, at + max_tokens)], agreed, self.cfg.min_n)

    def _matches(self) -> list[int]:
        """Where the latest earlier occurrences of the longest matching suffix end, most recent first."""
        ids, end = self.ids, len(self.ids)
        for n in range(min(self.cfg.max_n, end), self.cfg.min_n - 1, -1):
            ends = self._last[n].get(tuple(ids[end - n:]))
            if ends:
                return ends
        return []


def agreement(ids: list[int], at: int, end: int, longest: int = 256) -> int:
    """Tokens before ``end`` that repeat the tokens before ``at`` (< ``end``), counted back to at most ``longest``,
    through at most EDITS small edits: where they stop agreeing, up to EDIT_TOKENS tokens inserted on either side
    are skipped (not counted) if the RESYNC tokens before them agree again. A refactor that renames a function
    copies its text with a few tokens changed at each use of the name; counted only back to the last change,
    its copies looked fresh after every use, worth 1-3 tokens a step."""
    i, j, total = at - 1, end - 1, 0
    for edit in range(EDITS + 1):
        n = _run_back(ids, i, j, min(longest - total, i + 1))
        i, j, total = i - n, j - n, total + n
        if edit == EDITS or i < 0 or total >= longest:
            break
        skip = next(((a, b) for a, b in _SKIPS if i - a - RESYNC + 1 >= 0 and i - a < j - b
                     and all(ids[i - a - q] == ids[j - b - q] for q in range(RESYNC))), None)
        if skip is None:
            break
        i, j = i - skip[0], j - skip[1]
    return total


def _run_back(ids: list[int], i: int, j: int, limit: int) -> int:
    """How many of ids[i], ids[i - 1], ... equal ids[j], ids[j - 1], ... in a row, at most ``limit`` (<= i + 1).
    Compared a slice of RUN_CHUNK at a time, then token by token: a HumanEval answer's copies agree back for
    hundreds of tokens, and the planner walks up to CANDIDATES of them every step (0.06 ms token by token)."""
    n = 0
    while n + RUN_CHUNK <= limit and ids[i - n - RUN_CHUNK + 1: i - n + 1] == ids[j - n - RUN_CHUNK + 1: j - n + 1]:
        n += RUN_CHUNK
    while n < limit and ids[i - n] == ids[j - n]:
        n += 1
    return n


# (tokens skipped before the copied text, before the sequence's end), fewest first
_SKIPS = sorted(((a, b) for a in range(EDIT_TOKENS + 1) for b in range(EDIT_TOKENS + 1) if a + b), key=sum)


@dataclass(frozen=True)
class Copy:
    """An n-gram proposal and how far the sequence already agrees with the text it is copied from."""

    tokens: list[int]  # the proposal: what followed the match
    agreed: int  # tokens before the proposal that the sequence repeats from the same place (>= the match's n),
    # through small edits (agreement)
    min_n: int = NgramConfig.min_n  # the shortest match: agreement past it is evidence that the copy holds

    def survival(self) -> list[float]:
        """S(1), ..., S(len(tokens)): the chance that the proposal's first j tokens all hold.

        A copy runs, then breaks (a refactor's copies hold for 10-30 tokens and break at the renamed name; a
        summary quotes a phrase and leaves it), so what it is worth depends on how long it has already run,
        not on a per-token coin. With A = agreed - min_n tokens of agreement beyond the shortest match,
        Laplace's rule of succession gives (A+1)/(A+2) for the next token, and for the first j tokens

            S(j) = prod_{i < j} (A+1+i) / (A+2+i) = (A+1) / (A+1+j)

        A fresh match (A = 0) is worth little (S(1) = 1/2, S(8) = 1/9); one that has agreed for 30 tokens is
        worth a long chain (S(16) = 0.66). It needs no state beyond the sequence itself, so plain steps and
        drafting steps inform it alike. Replayed through the planner at one request on Qwen 1.5B's greedy
        outputs (128 tokens, the CPU's calibrated verification costs), it takes the grounded workload's refactors
        to 1.60x (oracle bound 1.93x; 1.33x with agreement counted only back to the last edit) and its summaries
        to 1.03x (bound 1.39x), and HumanEval completions to 1.58-1.62x.
        """
        a = max(0, self.agreed - self.min_n) + 1
        return [a / (a + j) for j in range(1, len(self.tokens) + 1)]


# run lengths (tokens of agreement past the shortest match) that share a learned hazard: dense where copies start,
# wider where they have run long and observations are few
RUN_BUCKETS = (0, 1, 2, 3, 5, 8, 12, 17, 24, 33, 48, 64, 96, 128, 192, 256)
# classes of requests by the share of their output so far that their copies foresaw (CopyShare): a request
# restating its prompt's code and a chat answer borrowing a phrase learn separate hazards
SHARE_CLASSES = (0.0, 0.2, 0.4, 0.6, 0.8)
HAZARD_PRIOR = 8.0  # pseudo-tokens of Laplace's hazard each bucket starts with (2 and 4: bolder, lost under load)
HAZARD_DECAY = 0.98  # a class's counts fade by this at each of its verified copies: it follows a change of traffic


@dataclass
class CopyShare:
    """How much of one request's output so far its n-gram proposals foresaw: of the tokens each step produced,
    those that continued the step's proposal from its start (whether or not the step verified it)."""

    foreseen: int = 0
    produced: int = 0

    def update(self, proposal: list[int], produced: list[int]) -> None:
        self.foreseen += sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(proposal, produced)))
        self.produced += len(produced)

    @property
    def value(self) -> float:
        return (self.foreseen + 1) / (self.produced + 2)


class CopyHazard:
    """Learned chance that a copy breaks at its next token, by how long it has run and by its request's CopyShare
    (one per server, all requests).

    ``Copy.survival`` prices every copy by Laplace's rule, the same on every workload. Copies differ by workload:
    a function restated from its docstring holds for 30-40 tokens once it runs, a chat answer's phrase borrowed
    from the question breaks after a few. For each class of requests (SHARE_CLASSES) and bucket of run lengths
    this counts the verified copy tokens that held and those at which a copy broke, starting from HAZARD_PRIOR
    pseudo-tokens of Laplace's hazard 1/(A+2) and fading by HAZARD_DECAY, and prices a copy by what the server
    has seen of requests like its own. Replayed at one request through the planner (calid.bench.plan_replay) on
    Qwen 1.5B's greedy outputs of 24 HumanEval and 24 mixed chat prompts (chat template, EOS honoured, the 2-core
    EPYC's verification costs to 64 tokens, learning online from the first request on): HumanEval 1.58x ->
    1.64x ar decoding (1.67x after the mix), the mix 1.21x -> 1.22x (after HumanEval too). One table for all
    requests took HumanEval to 1.71x but the mix after it to 1.04x, and to 0.93x at 4 requests: a server that had
    learned code's long copies drafted chat's short ones as if they held.
    """

    def __init__(self, prior: float = HAZARD_PRIOR, decay: float = HAZARD_DECAY):
        self.prior, self.decay = prior, decay
        self.held = [[0.0] * len(RUN_BUCKETS) for _ in SHARE_CLASSES]
        self.broke = [[0.0] * len(RUN_BUCKETS) for _ in SHARE_CLASSES]

    def survival(self, copy: Copy, share: float = 0.0) -> list[float]:
        """S(1), ..., S(len(copy.tokens)) as ``Copy.survival``, by the hazards learned for requests whose CopyShare
        is ``share``: only the runs the copy asks for (one that agrees 200 tokens back asks for runs 198..), the
        bucket's counts read once per bucket (every verified copy changes them: a cache of hazards lasted a step)."""
        k, run = _share_class(share), max(0, copy.agreed - copy.min_n)
        held, broke, prior = self.held[k], self.broke[k], self.prior
        out, s, b = [], 1.0, _bucket(run)
        for a in range(run, run + len(copy.tokens)):
            if b + 1 < len(RUN_BUCKETS) and a >= RUN_BUCKETS[b + 1]:
                b += 1
            s *= 1.0 - (broke[b] + prior / (a + 2)) / (held[b] + broke[b] + prior)
            out.append(s)
        return out

    def observe(self, copy: Copy, share: float, verified: int, held: int) -> None:
        """A verification of the copy's first ``verified`` tokens kept ``held`` of them (``held < verified``: it
        broke at token ``held``); ``share``: its request's CopyShare when it was planned."""
        k, run = _share_class(share), max(0, copy.agreed - copy.min_n)
        held_k, broke_k = self.held[k], self.broke[k]
        for b in range(len(RUN_BUCKETS)):
            held_k[b] *= self.decay
            broke_k[b] *= self.decay
        for i in range(min(verified, held + 1)):
            b = _bucket(run + i)
            if i < held:
                held_k[b] += 1
            else:
                broke_k[b] += 1


def _bucket(run: int) -> int:
    return bisect.bisect_right(RUN_BUCKETS, run) - 1


def _share_class(share: float) -> int:
    return bisect.bisect_right(SHARE_CLASSES, share) - 1
