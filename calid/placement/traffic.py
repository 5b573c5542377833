"""Load shapes and their scoring for ``calid bench load`` (pure: no Ray, no model).

Terms:
  trace        real arrivals with prompt and output lengths (Azure LLM inference trace 2023, conversation
               services); replayed from its first request, times relative to it;
  rate         mean requests per second of a replay: the trace's inter-arrival gaps are scaled by one
               factor, so its burstiness is kept;
  capacity     the request rate the server sustains with plain decoding (ar), measured in the same run
               (tokens/s at the highest concurrency / mean output tokens);
  TTFT         arrival (the client's send) to the first output token;
  TPOT         time per output token after the first: (last token - first token) / (tokens - 1);
  goodput      output tokens per second of the requests that met the SLO (TTFT <= ttft_s and TPOT <= tpot_s),
               over the run's wall time (first send to last token) — DistServe's notion, per token.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

# the first 2,000 requests of the Azure LLM inference trace 2023 (conversation services), shipped here with its
# source and license (data/README.md); --trace takes the whole file
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "azure_llm_trace_2023_conv_sample.csv"


@dataclass(frozen=True)
class TraceRequest:
    at_s: float  # arrival, seconds after the replay starts
    prompt_tokens: int
    output_tokens: int


@dataclass
class Outcome:
    """One request as the client saw it."""

    sent_s: float
    first_s: float | None  # first output token (None: none arrived)
    last_s: float | None
    tokens: int
    error: str | None = None
    prompt: str = ""  # what the client asked (a chat's user message), and the text it got back: kept by the
    text: str = ""  # benchmarks that read the outputs themselves (the n-gram-copyable share)
    drafted: int | None = None  # output tokens that came from drafts, where the server says (calid's stats)
    retries: int = 0  # times the client sent it again after its connection failed before the server answered

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_s is None or self.tokens < 2:
            return None
        return (self.last_s - self.first_s) / (self.tokens - 1)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def met(self, o: Outcome) -> bool:
        return (o.error is None and o.ttft_s is not None and o.ttft_s <= self.ttft_s
                and (o.tpot_s is None or o.tpot_s <= self.tpot_s))


def read_trace(path: Path, n: int) -> list[TraceRequest]:
    """The trace's first ``n`` requests, times relative to the first."""
    out, t0 = [], None
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            at = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()  # microseconds at most
            t0 = at if t0 is None else t0
            out.append(TraceRequest(at - t0, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
            if len(out) == n:
                break
    if len(out) < n:
        raise ValueError(f"{path} holds {len(out)} requests, fewer than the {n} asked for")
    return out


def at_rate(trace: list[TraceRequest], rate_rps: float) -> list[TraceRequest]:
    """``trace`` with its gaps scaled so that its mean rate is ``rate_rps`` requests per second."""
    if rate_rps <= 0:
        raise ValueError(f"rate must be > 0, got {rate_rps}")
    span = trace[-1].at_s - trace[0].at_s
    if len(trace) < 2 or span <= 0:
        return [TraceRequest(0.0, r.prompt_tokens, r.output_tokens) for r in trace]
    factor = (len(trace) - 1) / rate_rps / span
    return [TraceRequest((r.at_s - trace[0].at_s) * factor, r.prompt_tokens, r.output_tokens) for r in trace]


def capped(trace: list[TraceRequest], max_prompt: int, max_output: int) -> list[TraceRequest]:
    return [TraceRequest(r.at_s, max(1, min(r.prompt_tokens, max_prompt)), max(1, min(r.output_tokens, max_output)))
            for r in trace]


def cut_prompts(corpus_ids: list[int], lengths: list[int]) -> list[list[int]]:
    """Consecutive windows of ``corpus_ids`` (real text, tokenized) of the given lengths, wrapping around."""
    if not corpus_ids:
        raise ValueError("the prompt corpus is empty")
    out, at = [], 0
    for n in lengths:
        ids = [corpus_ids[(at + i) % len(corpus_ids)] for i in range(n)]
        at = (at + n) % len(corpus_ids)
        out.append(ids)
    return out


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def score(outcomes: list[Outcome], slo: Slo) -> dict:
    """Throughput, goodput, SLO attainment and TTFT / TPOT p50 and p99 (milliseconds) of one run."""
    done = [o for o in outcomes if o.error is None and o.last_s is not None]
    start = min((o.sent_s for o in outcomes), default=0.0)
    end = max((o.last_s for o in done), default=start)
    wall = max(end - start, 1e-9)
    ttft = [o.ttft_s * 1000 for o in done if o.ttft_s is not None]
    tpot = [o.tpot_s * 1000 for o in done if o.tpot_s is not None]
    good = [o for o in done if slo.met(o)]
    return {
        "requests": len(outcomes), "errors": len(outcomes) - len(done), "tokens": sum(o.tokens for o in done),
        "tok_s": sum(o.tokens for o in done) / wall, "goodput_tok_s": sum(o.tokens for o in good) / wall,
        "slo_met": len(good) / len(outcomes) if outcomes else float("nan"),
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
        "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p99": percentile(tpot, 99),
    }
