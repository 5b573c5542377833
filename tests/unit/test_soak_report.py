"""calid bench soak's arithmetic: outcomes in and out of kill windows, lost tokens, memory trend, verdicts."""
from __future__ import annotations

import pytest

from calid.bench.soak_report import (CUT, FAILED, REFUSED, SERVED, Record, Tally, compare, is_near_tie,
                                     latency_windows, parse_duration, rss_slope_pct_per_hour, tie_margin, verdicts)
from calid.errors import CalidError


def test_a_failure_counts_against_the_retry_budget_only_near_a_kill():
    t = Tally(kills=[(100.0, "draft")])
    t.add(Record("grpc-stream", 90, 105, FAILED, "UNAVAILABLE"))  # in flight when the replica died
    t.add(Record("grpc-unary", 150, 151, FAILED, "UNAVAILABLE"))  # inside the 60 s after it
    t.add(Record("grpc-unary", 300, 301, FAILED, "INTERNAL"))  # long after: a real failure
    t.add(Record("grpc-unary", 10, 12, SERVED, tokens=16))
    t.add(Record("burst", 20, 20.1, REFUSED, "RESOURCE_EXHAUSTED"))
    t.add(Record("grpc-cancel", 30, 31, CUT))
    c = t.counts(window_s=60)
    assert (c["failed_in_kill_windows"], c["failed_outside_kill_windows"]) == (2, 1)
    assert c["failures"] == {"grpc-stream: UNAVAILABLE": 1, "grpc-unary: UNAVAILABLE": 1, "grpc-unary: INTERNAL": 1}
    assert (c["served"], c["tokens"], c["cut_by_client"], c["refused"]) == (1, 16, 1, {"RESOURCE_EXHAUSTED": 1})


@pytest.mark.parametrize("got, limit, verdict", [
    ([1, 2, 3], 3, (0, None)),  # the reference's first tokens
    ([1, 2, 3, 4, 5], 8, (0, None)),  # ended at EOS where the reference did
    ([1, 2], 3, (1, None)),  # one token missing
    ([1], 8, (4, None)),  # four missing
    ([1, 9, 3], 3, (0, 1)),  # another token at the second place: past it, nothing can be told
    ([1, 2, 3, 4, 5, 6], 8, (0, 5)),  # one past the reference's end
])
def test_an_answer_against_the_reference(got, limit, verdict):
    assert compare(got, [1, 2, 3, 4, 5], limit) == verdict


def test_an_answer_that_chose_eos_early_differs_where_it_stopped_and_lost_nothing():
    assert compare([1, 2], [1, 2, 3, 4, 5], 8, eos=True) == (0, 2)
    assert compare([1, 2], [1, 2, 3, 4, 5], 8, eos=False) == (3, None)  # cut short without choosing to: lost
    assert compare([1, 2, 3], [1, 2, 3, 4, 5], 3, eos=True) == (0, None)  # at its limit: nothing to tell


def test_answers_that_differ_are_counted_apart_from_tokens_missing():
    t = Tally()
    t.add(Record("grpc-unary", 0, 1, SERVED, tokens=3, lost=2))
    t.add(Record("grpc-stream", 0, 1, SERVED, tokens=8, differs=True))
    t.add(Record("http-stream", 0, 1, SERVED, tokens=8, differs=True, wrong=True))
    c = t.counts(window_s=60)
    assert (c["lost_tokens"], c["answers_not_identical"], c["not_identical_past_a_near_tie"]) == (2, 2, 1)


def test_a_difference_is_a_near_tie_only_when_the_target_scored_both_tokens_alike():
    top = [(7, -0.70), (9, -0.72)]
    assert tie_margin(top, 9) == pytest.approx(0.02) and is_near_tie(tie_margin(top, 9))
    assert tie_margin(top, None) == pytest.approx(0.02)  # the token taken unknown: the runner-up's margin
    assert tie_margin(top, 4) is None and not is_near_tie(None)  # not even among the target's alternatives
    assert not is_near_tie(tie_margin([(7, -0.1), (9, -2.5)], 9))  # a clear choice: a real difference
    assert not is_near_tie(tie_margin([(7, -0.1), (9, -0.7)], None))
    assert tie_margin([(7, -0.1)], 9) is None


def test_rss_slope_is_percent_of_the_mean_per_hour_after_the_warm_up():
    flat = [(t, 100e6) for t in range(0, 600, 5)]
    assert rss_slope_pct_per_hour(flat) == pytest.approx(0.0)
    # warm-up growth, then flat: skipping the warm-up says flat
    warm = [(t, 50e6 + 1e6 * t) for t in range(0, 50, 5)] + [(t, 100e6) for t in range(50, 600, 5)]
    assert rss_slope_pct_per_hour(warm, skip_s=60) == pytest.approx(0.0)
    # 1 MB a minute on 100 MB: 60% an hour
    leak = [(t, 100e6 + 1e6 * t / 60) for t in range(0, 600, 5)]
    assert rss_slope_pct_per_hour(leak) == pytest.approx(60 / 1.05, rel=0.01)
    assert rss_slope_pct_per_hour(flat[:3]) is None and rss_slope_pct_per_hour(flat[:10]) is None  # too short


def test_latency_early_and_late():
    records = [Record("grpc-unary", t, t + (1 if t < 50 else 3), SERVED) for t in range(0, 100, 2)]
    w = latency_windows(records, duration_s=100, window_s=30)
    assert (w["first"]["p50_s"], w["last"]["p50_s"], w["first"]["requests"]) == (1, 3, 15)


def test_verdicts_name_every_problem():
    ok = {"failed_outside_kill_windows": 0, "failures": {}, "lost_tokens": 0, "not_identical_past_a_near_tie": 0}
    assert verdicts(ok, {"target[1]": 1.0, "draft[2]": None}, {"active": 0}, 5.0) == []
    bad = verdicts({**ok, "lost_tokens": 3, "not_identical_past_a_near_tie": 1}, {"target[1]": 7.5},
                   {"active": 0, "target_kv": 2}, 5.0)
    assert bad == ["3 tokens missing from completed greedy answers",
                   "1 completed greedy answers differ from the reference where the target's choice was not a "
                   "near-tie (> 0.5 nats)",
                   "target[1]: RSS grows 7.5% per hour (limit 5%)", "not back to idle at the end: {'target_kv': 2}"]


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("30m", 1800), ("2h", 7200), ("45", 45), ("0", 0)])
def test_durations(text, seconds):
    assert parse_duration(text, "duration") == seconds


@pytest.mark.parametrize("text", ["soon", "-5m", "m"])
def test_a_bad_duration_names_the_flag(text):
    with pytest.raises(CalidError, match="--kill-every"):
        parse_duration(text, "kill_every")


def test_an_error_event_in_an_http_stream_is_the_requests_failure_not_a_short_answer():
    """calid's HTTP stream reports a failure after its first byte (a request timeout, a worker gone) as an
    error event with status 200 already sent; the soak once counted one as a served answer 160 tokens short."""
    from serve_app.bench.soak import _HttpStatus, _sse_event

    assert _sse_event(": keep-alive") is None and _sse_event("data: [DONE]") is None
    assert _sse_event('data: {"choices": [{"delta": {"content": "x"}}]}')["choices"][0]["delta"]["content"] == "x"
    with pytest.raises(_HttpStatus) as e:
        _sse_event('data: {"error": {"message": "request did not finish within request_timeout_s=600", '
                   '"type": "timeout", "code": 504}}')
    assert e.value.status == 504


def test_a_filter_answer_that_differs_is_kept_as_a_switch_not_judged_by_the_targets_margin():
    """A filter token comes from the draft or the target by the draft's confidence, which the reference's
    target logprobs do not show: the same difference (7.8 nats from the target's top choice) is wrong in ar and
    a filter switch in filter."""
    from serve_app.bench.soak import _Soak

    soak = _Soak.__new__(_Soak)  # only what _differs reads
    soak.mismatches, soak.t0 = [], 0.0
    tops = [[(5, -0.1), (6, -2.0)], [(7, -0.01), (8, -7.81)]]
    for mode, wrong in (("ar", True), ("filter", False)):
        assert soak._differs("grpc", mode, 0, 16, 16, tops, 1, 9, {"first_difference": 1}) is wrong
    assert [m.get("filter_switch", False) for m in soak.mismatches] == [False, True]
