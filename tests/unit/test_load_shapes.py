"""calid.placement.traffic: the trace replay's shaping and the run's scoring, on hand-built data and the real trace."""
from __future__ import annotations

from pathlib import Path

import pytest

from calid.placement import traffic as load
from calid.placement.traffic import Outcome, Slo, TraceRequest

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "azure-llm-trace-2023" / \
    "AzureLLMInferenceTrace_conv.csv"


def test_scaling_to_a_rate_keeps_the_shape_of_the_gaps():
    trace = [TraceRequest(10.0, 5, 3), TraceRequest(11.0, 6, 4), TraceRequest(14.0, 7, 5)]
    out = load.at_rate(trace, 2.0)  # 2 gaps over 1 s
    assert [r.at_s for r in out] == pytest.approx([0.0, 0.25, 1.0])
    assert [(r.prompt_tokens, r.output_tokens) for r in out] == [(5, 3), (6, 4), (7, 5)]
    with pytest.raises(ValueError):
        load.at_rate(trace, 0)


def test_caps_and_prompt_windows():
    assert load.capped([TraceRequest(0, 900, 0)], 256, 32) == [TraceRequest(0, 256, 1)]
    assert load.cut_prompts([1, 2, 3, 4, 5], [2, 2, 3]) == [[1, 2], [3, 4], [5, 1, 2]]
    with pytest.raises(ValueError):
        load.cut_prompts([], [1])


def test_score_counts_goodput_only_for_requests_within_the_slo():
    fast = Outcome(0.0, 1.0, 2.0, 11)  # TTFT 1 s, TPOT 0.1 s
    slow = Outcome(0.0, 5.0, 6.0, 11)  # TTFT 5 s
    failed = Outcome(0.0, None, None, 0, error="UNAVAILABLE")
    s = load.score([fast, slow, failed], Slo(ttft_s=2.0, tpot_s=0.5))
    assert s["requests"] == 3 and s["errors"] == 1 and s["tokens"] == 22
    assert s["tok_s"] == pytest.approx(22 / 6.0) and s["goodput_tok_s"] == pytest.approx(11 / 6.0)
    assert s["slo_met"] == pytest.approx(1 / 3)
    assert s["ttft_ms_p50"] == pytest.approx(1000) and s["ttft_ms_p99"] == pytest.approx(5000)
    assert s["tpot_ms_p50"] == pytest.approx(100)


def test_percentile_is_nearest_rank():
    xs = list(range(1, 101))
    assert load.percentile(xs, 50) == 50 and load.percentile(xs, 99) == 99 and load.percentile(xs, 100) == 100
    assert load.percentile([], 50) != load.percentile([], 50)  # NaN


@pytest.mark.skipif(not TRACE.is_file(), reason="the Azure trace is not on this machine")
def test_the_real_trace_reads_from_its_first_request():
    trace = load.read_trace(TRACE, 50)
    assert len(trace) == 50 and trace[0].at_s == 0.0
    assert all(b.at_s >= a.at_s for a, b in zip(trace, trace[1:]))
    assert all(r.prompt_tokens > 0 and r.output_tokens >= 0 for r in trace)
    with pytest.raises(ValueError):
        load.read_trace(TRACE, 10**6)
