"""Per-model arrival processes for the placement planner and its simulator.

Terms:
  rate   mean requests per second of one model
  CV     coefficient of variation of the gaps between a model's arrivals (std / mean): 1 is Poisson, 4 is
         the burstiness AlpaServe reports for production function traces (bursts of many requests, then
         long quiet)
  Gamma  arrivals whose gaps are Gamma distributed with a given rate and CV (shape 1/CV^2), AlpaServe's way
         of turning a trace into a workload at any rate and burstiness
  trace  the Azure LLM inference trace (conversation services): its requests' prompt and output lengths,
         and, without --cv, its own gaps (rescaled to the rate) as the arrival process
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from calid.placement.traffic import TraceRequest


@dataclass(frozen=True)
class Request:
    at_s: float
    model: str
    prompt_tokens: int
    output_tokens: int


def gamma_gaps(rate: float, cv: float, n: int, rng: random.Random) -> list[float]:
    if rate <= 0 or cv <= 0:
        raise ValueError(f"rate and CV must be > 0, got rate={rate} cv={cv}")
    shape = 1.0 / (cv * cv)
    return [rng.gammavariate(shape, 1.0 / (rate * shape)) for _ in range(n)]


def trace_gaps(trace: list[TraceRequest]) -> list[float]:
    return [b.at_s - a.at_s for a, b in zip(trace, trace[1:])]


def cv_of(gaps: list[float]) -> float:
    mean = sum(gaps) / len(gaps)
    var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    return math.sqrt(var) / mean if mean > 0 else 0.0


def workload(models: dict[str, float], duration_s: float, lengths: list[TraceRequest], cv: float | None,
             seed: int = 0, max_prompt: int | None = None, max_output: int | None = None) -> list[Request]:
    """Arrivals for each model (``models``: name -> rate) over ``duration_s``, in time order.

    Gaps: Gamma with ``cv``, or, with ``cv`` None, the trace's own gaps rescaled to each model's rate (each
    model reads the trace from its own offset, so their bursts do not coincide). Prompt and output lengths
    are the trace's, in order, capped at ``max_prompt`` / ``max_output`` (this machine decodes short answers).
    """
    if not lengths:
        raise ValueError("no trace requests to take lengths from")
    rng = random.Random(seed)
    own = trace_gaps(lengths) if cv is None else None
    if own is not None and (len(own) < 2 or sum(own) <= 0):
        raise ValueError("the trace has too few requests to take gaps from; give a CV instead")
    out: list[Request] = []
    for k, (name, rate) in enumerate(sorted(models.items())):
        if rate <= 0:
            continue
        mean_gap = 1.0 / rate
        start = (k * len(lengths)) // max(len(models), 1)
        scale = mean_gap / (sum(own) / len(own)) if own is not None else 1.0
        t, i = rng.uniform(0, mean_gap), start
        while t < duration_s:
            r = lengths[i % len(lengths)]
            out.append(Request(t, name, min(r.prompt_tokens, max_prompt or r.prompt_tokens),
                               max(1, min(r.output_tokens, max_output or r.output_tokens))))
            gap = own[i % len(own)] * scale if own is not None else gamma_gaps(rate, cv, 1, rng)[0]
            t, i = t + gap, i + 1
    out.sort(key=lambda r: (r.at_s, r.model))
    return out
