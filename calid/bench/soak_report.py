"""``calid bench soak``'s arithmetic, apart from the server it drives: each request's outcome, the memory trend of
each process, latency early against late, and the verdicts the summary prints."""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

# outcomes of one request
SERVED, REFUSED, FAILED, CUT = "served", "refused", "failed", "cut"  # CUT: the client stopped it on purpose


@dataclass
class Record:
    kind: str  # what was sent, e.g. "grpc-stream", "http-disconnect", "bad-request", "burst"
    start: float  # seconds since the soak began
    end: float
    outcome: str  # SERVED | REFUSED | FAILED | CUT
    reason: str = ""  # a refusal's or failure's status (RESOURCE_EXHAUSTED, INVALID_ARGUMENT, ...)
    tokens: int = 0
    lost: int = 0  # tokens a completed greedy answer is missing: it is the reference's beginning, but short
    differs: bool = False  # a completed greedy answer that is not the reference's (another token somewhere)
    wrong: bool = False  # ... and where it first differs, the target's own choice was not a near-tie
    ttft_s: float | None = None


@dataclass
class Tally:
    records: list[Record] = field(default_factory=list)
    kills: list[tuple[float, str]] = field(default_factory=list)  # (seconds since start, what was killed)

    def add(self, r: Record) -> None:
        self.records.append(r)

    def in_kill_window(self, r: Record, window_s: float) -> bool:
        """Whether ``r`` was in flight while a replica died or within window_s after (the SDK's retry budget)."""
        return any(r.start <= t + window_s and r.end >= t for t, _ in self.kills)

    def counts(self, window_s: float) -> dict:
        served = [r for r in self.records if r.outcome == SERVED]
        failed = [r for r in self.records if r.outcome == FAILED]
        in_windows = [r for r in failed if self.in_kill_window(r, window_s)]
        return {
            "requests": len(self.records),
            "served": len(served),
            "tokens": sum(r.tokens for r in served),
            "cut_by_client": sum(r.outcome == CUT for r in self.records),
            "refused": dict(Counter(r.reason for r in self.records if r.outcome == REFUSED)),
            "failed_in_kill_windows": len(in_windows),
            "failed_outside_kill_windows": len(failed) - len(in_windows),
            "failures": dict(Counter(f"{r.kind}: {r.reason}" for r in failed)),
            "lost_tokens": sum(r.lost for r in served),
            "answers_not_identical": sum(r.differs for r in served),
            "not_identical_past_a_near_tie": sum(r.wrong for r in served),
            "by_kind": dict(Counter(r.kind for r in self.records)),
        }


def compare(got: list[int], reference: list[int], limit: int, eos: bool = False) -> tuple[int, int | None]:
    """A completed greedy answer of at most ``limit`` tokens against the reference answer (decoded alone, with a
    limit at least as long): (tokens missing, where it first differs). Missing: it is the reference's beginning
    but stops short without having chosen to (``eos``: it ended on an EOS, a choice that differs where the
    reference went on). Differs: another token at that position (or one past the reference's end); past it,
    what is missing cannot be told."""
    want = reference[:limit]
    for k, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return 0, k
    if len(got) > len(want):
        return 0, len(want)
    if len(got) < len(want) and eos:
        return 0, len(got)
    return len(want) - len(got), None


# Two candidates the target scores this close (in nats) are a tie that a batch's rounding may flip: llama.cpp sums
# a row in another order when other streams share its call (a 2.5-minute soak on SmolLM2 saw a flip at 0.2 nats
# of its batched forwards); corrupted state picks tokens far from the target's first two, not its runner-up
NEAR_TIE_NATS = 0.5


def tie_margin(top: list[tuple[int, float]], taken: int | None) -> float | None:
    """How close a greedy choice was where an answer took another token than the reference: the reference's
    top logprob at that position (``top``: (token, logprob), most likely first) minus the logprob of the token
    taken instead, or minus the runner-up's when that token is not known (an HTTP answer's text, an EOS). None
    when the token taken is not among the reference's alternatives: no tie at all."""
    if len(top) < 2:
        return None
    if taken is None:
        return top[0][1] - top[1][1]
    lp = dict(top).get(taken)
    return None if lp is None else top[0][1] - lp


def is_near_tie(margin: float | None) -> bool:
    return margin is not None and margin <= NEAR_TIE_NATS


def rss_slope_pct_per_hour(samples: list[tuple[float, float]], skip_s: float = 0.0) -> float | None:
    """A process's memory trend: the least-squares slope of its RSS over time after ``skip_s`` (warm-up), in
    percent of its mean RSS per hour; None with fewer than 4 samples or under a minute of them."""
    pts = [(t, m) for t, m in samples if t >= samples[0][0] + skip_s] if samples else []
    if len(pts) < 4 or pts[-1][0] - pts[0][0] < 60:
        return None
    ts, ms = [t for t, _ in pts], [m for _, m in pts]
    slope = statistics.linear_regression(ts, ms).slope  # bytes per second
    return 100.0 * slope * 3600 / statistics.fmean(ms)


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def latency_windows(records: list[Record], duration_s: float, window_s: float) -> dict:
    """p50/p99 of served requests' latency (their whole time) in the first and the last ``window_s``."""
    out = {}
    for name, lo, hi in (("first", 0.0, window_s), ("last", duration_s - window_s, duration_s)):
        xs = [r.end - r.start for r in records if r.outcome == SERVED and r.kind != "burst" and lo <= r.start < hi]
        out[name] = {"requests": len(xs), "p50_s": percentile(xs, 50), "p99_s": percentile(xs, 99)}
    return out


def verdicts(counts: dict, slopes: dict[str, float | None], idle: dict, max_slope_pct: float) -> list[str]:
    """What failed, one line each (empty: the soak passed)."""
    bad = []
    if counts["failed_outside_kill_windows"]:
        bad.append(f"{counts['failed_outside_kill_windows']} requests failed outside the kill windows: "
                   f"{counts['failures']}")
    if counts["lost_tokens"]:
        bad.append(f"{counts['lost_tokens']} tokens missing from completed greedy answers")
    if counts["not_identical_past_a_near_tie"]:
        bad.append(f"{counts['not_identical_past_a_near_tie']} completed greedy answers differ from the reference "
                   f"where the target's choice was not a near-tie (> {NEAR_TIE_NATS} nats)")
    for proc, slope in slopes.items():
        if slope is not None and slope >= max_slope_pct:
            bad.append(f"{proc}: RSS grows {slope:.1f}% per hour (limit {max_slope_pct:g}%)")
    left = {k: v for k, v in idle.items() if v}
    if left:
        bad.append(f"not back to idle at the end: {left}")
    return bad


UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str, flag: str) -> float:
    """``90s``, ``30m``, ``2h`` or plain seconds -> seconds; CalidError naming the flag otherwise."""
    from calid.errors import CalidError

    text = str(text).strip().lower()
    unit = UNITS.get(text[-1:], None)
    number = text[:-1] if unit else text
    try:
        value = float(number) * (unit or 1.0)
    except ValueError:
        raise CalidError(f"--{flag.replace('_', '-')} takes a duration such as 90s, 30m or 2h, got {text!r}") from None
    if value < 0:
        raise CalidError(f"--{flag.replace('_', '-')} must be >= 0, got {text!r}")
    return value
