"""A budget in the task's own metric for filter decoding: ``max_quality_loss``, the points of task quality (HumanEval
pass@1 for the shipped pair) that filter may lose against ``ar``, turned into a threshold by a table measured per
pair.

The table comes from ``calid bench pareto``: ar and filter at several thresholds answer the same items, and on the
calibration half (even-numbered items) each threshold t has a paired loss: per item d = ar solved - filter solved
(1, 0 or -1), loss(t) = mean(d) in points, with its standard error. The budget b picks a threshold by fixed-sequence
testing (Learn then Test): walk the thresholds from the most cautious (highest) down, keep going while

    loss(t) + Z * se(t) <= b        (Z: the one-sided normal quantile of CONFIDENCE)

and stop at the first that fails; the budget's threshold is the last that passed (the lowest, so the most drafted),
or 1.0 (the target for every token: served as auto, ``budget_mode``) when even the highest fails. Each step is a
one-sided test of "the expected loss at t exceeds b" at level 1 - CONFIDENCE; walked in a fixed order and stopped at
the first failure, the whole walk errs (picks a threshold whose expected loss exceeds b) with probability at most
that level, without a correction for the number of thresholds. The standard error counts one discordant item more
than seen, so a threshold with no observed difference is not taken as certain.

What it promises: over items like the calibration's (the same task, prompts of the same kind), filter at the chosen
threshold loses at most b points of the metric in expectation, with CONFIDENCE. Not per answer (one answer passes or
fails), and not on another task: a budget is only as good as the items it was calibrated on. ``calid bench pareto``
checks each budget on the held-out half (odd-numbered items), which the choice never read.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from calid.models.presets import DEFAULT_DRAFT, DEFAULT_TARGET
from calid.paths import pair_calibration

CONFIDENCE = 0.9  # the chance that the walk picks no threshold whose expected loss exceeds the budget
Z = 1.2815515655446004  # the one-sided normal quantile of CONFIDENCE


@dataclass(frozen=True)
class LossPoint:
    """filter at one threshold against ar on the same calibration items."""

    threshold: float
    loss_points: float  # mean(ar solved - filter solved) x 100
    se_points: float  # its standard error x 100 (one extra discordant item counted)
    items: int
    filtered_fraction: float | None = None  # output tokens from the draft, where measured

    @property
    def upper(self) -> float:
        return self.loss_points + Z * self.se_points


def paired_loss(threshold: float, ar: list[bool], filt: list[bool], filtered_fraction: float | None = None
                ) -> LossPoint:
    """The loss of filter at ``threshold`` against ar from per-item outcomes on the same items, in the same order."""
    if len(ar) != len(filt) or not ar:
        raise ValueError(f"paired outcomes need the same items on both sides, got {len(ar)} and {len(filt)}")
    n = len(ar)
    d = [int(a) - int(f) for a, f in zip(ar, filt)]
    mean = sum(d) / n
    discordant = sum(1 for x in d if x) + 1  # one more than seen: no observed difference is not certainty
    var = max(0.0, min(1.0, discordant / n) - mean * mean)
    return LossPoint(threshold, 100 * mean, 100 * math.sqrt(var / n), n, filtered_fraction)


@dataclass(frozen=True)
class QualityTable:
    """Per threshold, filter's measured loss against ar; ``task`` names the metric (its points are the budget's)."""

    points: tuple[LossPoint, ...]
    task: str = "humaneval pass@1"
    source: str = ""  # where it was measured (the command, date, concurrency)

    def __post_init__(self):
        thresholds = [p.threshold for p in self.points]
        if len(set(thresholds)) != len(thresholds) or any(not 0.0 <= t <= 1.0 for t in thresholds):
            raise ValueError(f"a quality table needs distinct thresholds in [0, 1], got {thresholds}")

    def walk(self, budget: float) -> list[tuple[LossPoint, bool]]:
        """The fixed-sequence walk for ``budget`` points: each threshold from the highest down with whether it
        passed, ending at the first that failed."""
        out = []
        for p in sorted(self.points, key=lambda p: -p.threshold):
            ok = p.upper <= budget + 1e-9
            out.append((p, ok))
            if not ok:
                break
        return out

    def threshold_for(self, budget: float) -> float:
        """The lowest threshold the walk reached for ``budget`` points; 1.0 when none passed."""
        passed = [p.threshold for p, ok in self.walk(budget) if ok]
        return passed[-1] if passed else 1.0

    def to_json(self) -> dict:
        return {"task": self.task, "source": self.source, "confidence": CONFIDENCE,
                "points": [asdict(p) for p in self.points]}

    @classmethod
    def from_json(cls, data: dict) -> "QualityTable":
        return cls(tuple(LossPoint(**p) for p in data["points"]), data.get("task", "humaneval pass@1"),
                   data.get("source", ""))


# filter's loss against ar per threshold, per pair: what max_quality_loss budgets are resolved by where no
# calibration file was written. Measured by calid bench pareto on the calibration half of HumanEval (the 82
# even-numbered problems), served (docs/benchmark-log.md, 2026-12-07 evening). With it 2 and 5 points resolve to
# 1.0 (82 problems cannot vouch for so little), 6 to 0.97 and 10 to 0.9; on the held-out half those lost 0.0 and
# 1.2 points.
PRESETS: dict[tuple[str, str], QualityTable] = {
    (DEFAULT_TARGET, DEFAULT_DRAFT): QualityTable((
        LossPoint(0.99, 2.439, 2.714, 82, 0.701),
        LossPoint(0.97, 1.220, 2.984, 82, 0.750),
        LossPoint(0.9, 4.878, 3.181, 82, 0.807),
    ), "humaneval pass@1", "calid bench pareto at 8 concurrent requests, AMD EPYC Zen 4, 2026-12-07"),
}


def budget_mode(threshold: float) -> str:
    """The mode a max_quality_loss budget resolved to ``threshold`` is served in: filter at that threshold, or
    auto where the table vouched for no threshold (1.0). Filter at 1.0 would have the draft propose every token
    and the target decide it: the target's own tokens with the draft's forwards on top (filter at 0.97 already
    read 0.88x ar at one request on a 2-core CPU: docs/benchmark-log.md, 2026-12-07 night); auto gives the
    target's tokens too (lossless) and drafts only where its planner finds it pays. An edge client's Collaborate
    stream keeps filter at 1.0: its draft runs on the client."""
    return "filter" if threshold < 1.0 else "auto"


def check_budget(budget) -> float:
    """``budget`` as points of task quality, or a ValueError that says what is accepted."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0.0 <= budget <= 100.0:
        raise ValueError(f"max_quality_loss is points of task quality in [0, 100] (2 = two points of pass@1), "
                         f"got {budget!r}")
    return float(budget)


def quality_path(target: str, draft: str) -> Path:
    """Where ``calid bench pareto`` writes, and serving reads, a target/draft pair's quality table."""
    return pair_calibration("quality", target, draft)


def table_for(target: str, draft: str | None, given: str | None = None) -> tuple[QualityTable | None, str]:
    """The pair's quality table and where it came from: ``given`` (a file; it must exist), else the calibration
    file ``calid bench pareto`` wrote for the pair, else the pair's preset (PRESETS), else None. An unreadable
    file: ValueError."""
    if draft is None:
        return None, "the model has no draft"
    path = Path(given).expanduser() if given else quality_path(target, draft)
    if given and not path.exists():
        raise ValueError(f"quality_table {path} does not exist")
    if path.exists():
        try:
            return QualityTable.from_json(json.loads(path.read_text())), str(path)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"quality calibration {path} is unreadable ({e}); delete it or rerun calid bench "
                             "pareto") from None
    preset = PRESETS.get((target, draft))
    if preset is not None:
        return preset, f"the pair's preset (calid.decoding.quality_budget.PRESETS: {preset.source})"
    return None, "no quality calibration for this pair (calid bench pareto writes one)"


def resolve_threshold(budget, table: QualityTable | None, source: str) -> float:
    """filter's threshold for ``budget`` points from the pair's ``table`` (``source``: where it came from, for the
    error when there is none)."""
    from calid.errors import InvalidRequestError, UncalibratedError

    try:
        budget = check_budget(budget)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    if table is None:
        raise UncalibratedError(f"max_quality_loss needs the pair's quality table: {source}")
    return table.threshold_for(budget)


def budget_decoding(budget, table: QualityTable | None, source: str, edge: bool = False) -> tuple[str, float]:
    """The (mode, threshold) a request with a max_quality_loss ``budget`` runs in: ``resolve_threshold``'s threshold,
    served by ``budget_mode`` (an ``edge`` client's stream keeps filter: its draft runs on the client)."""
    threshold = resolve_threshold(budget, table, source)
    return ("filter" if edge else budget_mode(threshold)), threshold
