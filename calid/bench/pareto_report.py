"""The arithmetic of ``calid bench pareto`` (served speed against quality): rows from stored answers and timed
segments, the operating point, the chart. No I/O but the PNG.

A *segment* is one uninterrupted closed-loop run of a configuration at a concurrency over the items it still
had to do; its wall time counts only when it finished (a stopped run's answers still count for quality, its time
does not). A configuration's served throughput at concurrency c: the tokens of its finished segments' answers
over their wall time; its speed-up: that over ar's at the same c.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from calid.decoding.quality_budget import LossPoint, QualityTable, paired_loss

POINTS = 2.0  # the operating point: pass@1 within this many points of ar


@dataclass(frozen=True)
class Segment:
    config: str
    c: int
    run: str  # the invocation that measured it (its start time): ratios across invocations are marked
    seconds: float
    keys: tuple[str, ...]  # the items it answered


def throughput(segments: list[Segment], answers: dict[str, dict]) -> tuple[float | None, set[str]]:
    """(output tokens / s over the finished segments, the runs that measured them); None without any."""
    tokens = seconds = 0.0
    runs = set()
    for s in segments:
        tokens += sum(answers[k]["tokens"] for k in s.keys if k in answers)
        seconds += s.seconds
        runs.add(s.run)
    return (tokens / seconds if seconds > 0 else None), runs


def summarize(configs: list[str], sweep: list[int], kinds: dict[str, str], answers: dict[tuple[str, int], dict],
              segments: list[Segment], held_out: set[str], budgeted: set[str]) -> list[dict]:
    """One row per configuration, concurrency and task kind (and "all" for speed). ``answers[(config, c)]``:
    item key -> {"tokens", "drafted", "text", "solved"}; ``kinds``: item key -> task kind; configurations in
    ``budgeted`` (min_agreement) answer the ``held_out`` items only, and their quality is compared with ar's on
    those items."""
    rows = []
    for c in sweep:
        ar = answers.get(("ar", c), {})
        ar_speed, ar_runs = throughput([s for s in segments if (s.config, s.c) == ("ar", c)], ar)
        for config in configs:
            got = answers.get((config, c), {})
            if not got:
                continue
            speed, runs = throughput([s for s in segments if (s.config, s.c) == (config, c)], got)
            for kind in sorted({kinds[k] for k in got}) + ["all"]:
                keys = [k for k in got if kind in ("all", kinds[k])]
                wanted = [k for k in kinds if kind in ("all", kinds[k]) and (config not in budgeted or k in held_out)]
                graded = [k for k in keys if got[k].get("solved") is not None]
                same = [k for k in graded if k in ar and ar[k].get("solved") is not None]
                tokens = sum(got[k]["tokens"] for k in keys)
                rows.append({
                    "config": config, "c": c, "task": kind,
                    "done": f"{len(keys)}/{len(wanted)}",
                    "quality": sum(got[k]["solved"] for k in graded) / len(graded) if graded else "-",
                    "ar_quality_same_items": sum(ar[k]["solved"] for k in same) / len(same) if same else "-",
                    "speedup_vs_ar": speed / ar_speed if speed and ar_speed else "-",
                    "tok_s": speed if speed else "-",
                    "filtered_fraction": sum(got[k]["drafted"] for k in keys) / tokens if tokens else "-",
                    "identical_to_ar": f"{sum(1 for k in keys if k in ar and ar[k]['text'] == got[k]['text'])}"
                                       f"/{sum(1 for k in keys if k in ar)}",
                    "ratio_across_runs": "yes" if speed and ar_speed and runs != ar_runs else "",
                })
    return rows


def operating_point(rows: list[dict], c: int, task: str = "humaneval") -> dict | None:
    """The lossy row at concurrency ``c`` with the largest filtered fraction whose ``task`` quality is within
    POINTS of ar's on the same items, every item answered."""
    ar = next((r for r in rows if (r["config"], r["c"], r["task"]) == ("ar", c, task)), None)
    if ar is None or not isinstance(ar["quality"], float):
        return None
    ok = [r for r in rows if r["c"] == c and r["task"] == task and r["config"] != "ar"
          and isinstance(r["quality"], float) and isinstance(r["ar_quality_same_items"], float)
          and isinstance(r["filtered_fraction"], float)
          and r["quality"] >= r["ar_quality_same_items"] - POINTS / 100
          and r["done"].split("/")[0] == r["done"].split("/")[1]]
    return max(ok, key=lambda r: r["filtered_fraction"], default=None)


def filter_threshold_of(config: str) -> float | None:
    m = re.fullmatch(r"filter t=([0-9.]+)", config)
    return float(m.group(1)) if m else None


def _paired(config: str, keys: list[str], ar: dict[str, dict], got: dict[str, dict]) -> LossPoint | None:
    """filter (``config``) against ar on ``keys``, both having graded every one of them; None otherwise."""
    if not keys or any(ar.get(k, {}).get("solved") is None or got.get(k, {}).get("solved") is None for k in keys):
        return None
    tokens = sum(got[k]["tokens"] for k in keys)
    drafted = sum(got[k]["drafted"] for k in keys) / tokens if tokens else None
    return paired_loss(filter_threshold_of(config), [ar[k]["solved"] for k in keys], [got[k]["solved"] for k in keys],
                       drafted)


def quality_table(answers: dict[tuple[str, int], dict], c: int, kinds: dict[str, str], held_out: set[str],
                  source: str, task: str = "humaneval") -> QualityTable | None:
    """filter's loss against ar per threshold at concurrency ``c`` on the calibration half of ``task`` (the items
    not in ``held_out``), from the thresholds that answered all of it; None without any."""
    keys = sorted(k for k in kinds if kinds[k] == task and k not in held_out)
    ar = answers.get(("ar", c), {})
    points = [p for (config, at), got in answers.items() if at == c and filter_threshold_of(config) is not None
              for p in [_paired(config, keys, ar, got)] if p is not None]
    if not points:
        return None
    return QualityTable(tuple(sorted(points, key=lambda p: -p.threshold)), f"{task} pass@1" if task == "humaneval"
                        else task, source)


def budget_rows(table: QualityTable, budgets: list[float], answers: dict[tuple[str, int], dict], c: int,
                kinds: dict[str, str], held_out: set[str], task: str = "humaneval") -> list[dict]:
    """Each loss budget's threshold as the calibration chose it, and the loss filter at that threshold showed on
    the held-out half at the same concurrency (the items the choice never read)."""
    keys = sorted(k for k in kinds if kinds[k] == task and k in held_out)
    ar = answers.get(("ar", c), {})
    rows = []
    for b in budgets:
        t = table.threshold_for(b)
        chosen = next((p for p in table.points if p.threshold == t), None)
        config = f"filter t={t:g}"
        held = None if t == 1.0 else _paired(config, keys, ar, answers.get((config, c), {}))
        rows.append({"budget_points": b, "c": c, "threshold": t,
                     "calibration_loss": _pm(chosen) if chosen else "0 (the target for every token)",
                     "held_out_loss": "0 (the target for every token)" if t == 1.0 else _pm(held) if held else "-",
                     "held_out_filtered": held.filtered_fraction if held and held.filtered_fraction is not None
                     else "-",
                     "holds": "yes" if t == 1.0 or (held and held.loss_points <= b + 1e-9) else
                     "no" if held else "not measured"})
    return rows


def _pm(p: LossPoint) -> str:
    return f"{p.loss_points:+.1f} +- {p.se_points:.1f} points ({p.items} items)"


def app_setting(config: str) -> str | None:
    """The app config line that serves ``config`` as filter's default (AppConfig.filter_threshold): for a filter
    threshold; None for the others, which a request sets for itself."""
    t = filter_threshold_of(config)
    return f"filter_threshold: {t:g}" if t is not None else None


def plot(rows: list[dict], task: str, path: Path) -> Path:
    """x: served speed-up over ar at the same concurrency; y: ``task`` quality; one line per concurrency through
    the configurations in order of speed-up, each point labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for c in sorted({r["c"] for r in rows}):
        pts = sorted((r["speedup_vs_ar"], r["quality"], r["config"]) for r in rows
                     if r["c"] == c and r["task"] == task and isinstance(r["speedup_vs_ar"], float)
                     and isinstance(r["quality"], float))
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{c} concurrent")
        for x, y, name in pts:
            ax.annotate(name, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("served throughput / ar's at the same concurrency")
    ax.set_ylabel(f"{task} quality (pass@1 / exact match)")
    ax.set_title(f"calid bench pareto: speed against quality, served ({task})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
