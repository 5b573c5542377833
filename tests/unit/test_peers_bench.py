"""calid bench peers' scoring: every run against one SLO from calid ar's lowest load, ratios per load."""
from __future__ import annotations

import argparse

import pytest

from calid.bench.load import Outcome
from calid.errors import CalidError
from serve_app.peers_bench import _replay_plan, _rows


def outcomes(n: int, ttft: float, tpot: float, tokens: int = 11) -> list[Outcome]:
    """``n`` requests sent one second apart, each with this TTFT and TPOT."""
    return [Outcome(i, i + ttft, i + ttft + tpot * (tokens - 1), tokens) for i in range(n)]


def test_rows_score_every_run_against_calid_ar_at_the_lowest_load():
    runs = [("calid", "ar", "c1", outcomes(4, 0.5, 0.1)), ("calid", "ar", "c4", outcomes(4, 1.0, 0.2)),
            ("calid", "ar", "trace", outcomes(4, 0.5, 0.1)),
            ("llama-server", "ar", "c4", outcomes(4, 3.0, 0.2)),  # TTFT beyond 5 x 0.5 s: misses the SLO
            ("llama-server", "ar", "trace", outcomes(4, 0.5, 0.6))]  # TPOT beyond 5 x 0.1 s
    rows, slo = _rows(runs, 5.0, limit=10.0)
    assert (slo.ttft_s, slo.tpot_s) == pytest.approx((2.5, 0.5))
    by = {(r["server"], r["load"]): r for r in rows}
    assert by["calid", "c4"]["slo_met"] == 1.0 and by["llama-server", "c4"]["slo_met"] == 0.0
    assert by["llama-server", "trace"]["slo_met"] == 0.0 and by["calid", "trace"]["tok_s_vs_calid_ar"] == 1.0
    # the same 44 tokens, last one at 3 + 1.0 + 2.0 = 6 s from calid vs 3 + 3.0 + 2.0 = 8 s from the peer
    c4 = by["llama-server", "c4"]
    assert c4["tok_s_vs_calid_ar"] == pytest.approx(6 / 8)
    assert by["calid", "c4"]["limit_tok_s"] == 40.0
    assert by["calid", "trace"]["limit_tok_s"] == "-"


def test_a_replay_without_its_trace_or_with_a_bad_rate_says_what_to_pass(tmp_path):
    args = argparse.Namespace(trace=str(tmp_path / "none.csv"), trace_rate=0.5, trace_requests=8,
                              max_prompt_tokens=64, max_new_tokens=8)
    with pytest.raises(CalidError, match="--trace '' to skip the replay"):
        _replay_plan(args, "smollm2-135m-instruct", [])
    (tmp_path / "t.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    args.trace, args.trace_rate = str(tmp_path / "t.csv"), 0
    with pytest.raises(CalidError, match="--trace-rate must be > 0"):
        _replay_plan(args, "smollm2-135m-instruct", [])
