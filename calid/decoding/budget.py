"""A token-agreement budget for filter decoding: ``min_agreement`` instead of a raw threshold (a share of
tokens that agree with the target, not of its task quality: docs/planner.md).

Agreement is the share of a request's output tokens that equal what the target
would choose (its top-1) given the same preceding tokens. In filter mode a
token the target generates agrees by definition; a draft token accepted at
confidence p agrees with probability r(p), the rate at which the draft's top-1
matches the target's at that confidence. With the draft's confidences split
into bins b (share s_b of positions, match rate r_b), a threshold t accepts
the bins at or above t, so

    agreement(t)         = 1 - sum_{b >= t} s_b (1 - r_b)
    filtered_fraction(t) =     sum_{b >= t} s_b

Both fall as t falls, so the lowest threshold whose agreement holds the budget
maximises the filtered fraction, and it rises with the budget.

``AgreementTable`` holds (positions, matches) per bin. It starts from a
calibration (``calid bench quality`` writes one per target/draft pair, measured
teacher-forced on the target's own greedy outputs) or, without one, from the
assumption that the draft is calibrated (r = p), each as a few pseudo-counts;
serving then adds what the target sees: when it catches up over accepted draft
tokens it compares its top-1 with each of them, and when it generates a token
the draft was unsure of it compares with the draft's held-back top-1.

``BudgetController`` keeps one request on budget: it asks the table for the
threshold of a budget corrected by the request's own shortfall so far.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from calid.paths import pair_calibration

BINS = 20  # bin b holds top-1 probabilities in [b / BINS, (b + 1) / BINS); a threshold is a bin edge
PRIOR_WEIGHT = 4.0  # pseudo-positions per bin the starting table weighs (a calibration file: scaled to this)
CORRECTION_SCALE = 16.0  # a request's own record weighs n / (n + this) against the table's prediction


def bin_of(prob: float) -> int:
    return min(BINS - 1, max(0, int(prob * BINS)))


@dataclass
class AgreementTable:
    positions: list[float] = field(default_factory=lambda: [PRIOR_WEIGHT] * BINS)
    matches: list[float] = field(default_factory=lambda: [PRIOR_WEIGHT * (b + 0.5) / BINS for b in range(BINS)])

    def __post_init__(self):
        if len(self.positions) != BINS or len(self.matches) != BINS:
            raise ValueError(f"an agreement table has {BINS} bins, got {len(self.positions)} and {len(self.matches)}")
        if any(m < 0 or m > n for n, m in zip(self.positions, self.matches)):
            raise ValueError("an agreement table's matches must lie in [0, positions] per bin")

    def observe(self, prob: float, match: bool) -> None:
        b = bin_of(prob)
        self.positions[b] += 1
        self.matches[b] += bool(match)

    def predict(self, threshold: float) -> tuple[float, float]:
        """(agreement, filtered fraction) expected at ``threshold``."""
        total = sum(self.positions)
        first = math.ceil(threshold * BINS - 1e-9)  # the lowest bin whose every probability is >= threshold
        kept = range(first, BINS)
        share = sum(self.positions[b] for b in kept) / total
        misses = sum(self.positions[b] - self.matches[b] for b in kept) / total
        return 1.0 - misses, share

    def threshold_for(self, min_agreement: float) -> float:
        """The lowest threshold (a bin edge) whose predicted agreement is at least ``min_agreement``
        (1.0, the target for every token, when none below it is)."""
        for edge in range(BINS + 1):
            t = edge / BINS
            if self.predict(t)[0] >= min_agreement - 1e-12:
                return t
        return 1.0

    @property
    def agreement_rate(self) -> float:
        """Share of the draft's top-1 tokens (over every bin) that matched the target's."""
        return sum(self.matches) / sum(self.positions)

    def curve(self) -> list[dict]:
        return [dict(zip(("threshold", "agreement", "filtered_fraction"), (e / BINS, *self.predict(e / BINS))))
                for e in range(BINS + 1)]

    # ---- the calibration file ----------------------------------------------------------

    @classmethod
    def from_counts(
        cls, positions: list[float], matches: list[float], weight: float = PRIOR_WEIGHT
    ) -> "AgreementTable":
        """A starting table from measured counts, scaled so that the busiest bin weighs ``weight`` positions
        per bin on average (a calibration guides serving without outweighing what serving then measures);
        empty bins keep the calibrated-draft prior."""
        prior = cls()
        total = sum(positions)
        if total <= 0:
            return prior
        scale = weight * BINS / total
        return cls([n * scale if n > 0 else p for n, p in zip(positions, prior.positions)],
                   [m * scale if n > 0 else pm for n, m, pm in zip(positions, matches, prior.matches)])

    def to_json(self, **meta) -> dict:
        return {"bins": BINS, "positions": self.positions, "matches": self.matches, "curve": self.curve(), **meta}

    @classmethod
    def load(cls, path: Path) -> "AgreementTable":
        data = json.loads(Path(path).read_text())
        if data.get("bins") != BINS:
            raise ValueError(f"{path}: calibration has {data.get('bins')} bins, this calid uses {BINS}")
        return cls.from_counts(data["positions"], data["matches"])


def calibration_path(target: str, draft: str) -> Path:
    """Where ``calid bench quality`` writes, and serving reads, a target/draft pair's agreement calibration."""
    return pair_calibration("agreement", target, draft)


def starting_table(target: str, draft: str | None) -> tuple[AgreementTable, Path | None]:
    """The pair's calibration when one was written (and the file it came from), else the calibrated-draft prior."""
    path = calibration_path(target, draft) if draft else None
    if path is not None and path.exists():
        try:
            return AgreementTable.load(path), path
        except (ValueError, KeyError, json.JSONDecodeError) as e:
            raise ValueError(f"agreement calibration {path} is unreadable ({e}); delete it or rerun "
                             "calid bench quality") from None
    return AgreementTable(), None


@dataclass
class BudgetController:
    """One request's threshold under ``min_agreement``: the table's threshold for the budget, corrected by
    how the request has done so far (agreed / counted tokens: target tokens and audited draft tokens)."""

    min_agreement: float
    agreed: float = 0.0
    counted: int = 0

    def record(self, agreed: int, counted: int) -> None:
        self.agreed += agreed
        self.counted += counted

    @property
    def realized(self) -> float:
        return self.agreed / self.counted if self.counted else 1.0

    def target(self) -> float:
        """The agreement to ask of the table now: the budget, raised by the shortfall so far (lowered by a
        surplus), weighted by how much of the request has been counted."""
        w = self.counted / (self.counted + CORRECTION_SCALE)
        return min(1.0, max(0.0, self.min_agreement + w * (self.min_agreement - self.realized)))

    def threshold(self, table: AgreementTable) -> float:
        return table.threshold_for(self.target())
