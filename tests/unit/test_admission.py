"""Admission by expected finish time (calid.admission): the measured rate and the rule."""
from __future__ import annotations

import pytest

from calid.admission import Backlog, TokenRate, budget_left


def test_the_rate_is_tokens_over_time_in_steps_and_forgets_what_is_past_its_window():
    rate = TokenRate(window_s=10.0)
    rate.add(4, 0.5)
    assert rate.per_s is None  # half a second measured: no estimate yet
    for _ in range(3):
        rate.add(4, 0.5)
    assert rate.per_s == pytest.approx(8.0)
    for _ in range(40):  # the server slows down: 20 s of steps at 2 tokens/s push the fast ones out
        rate.add(1, 0.5)
    assert rate.per_s == pytest.approx(2.0)


def test_a_request_that_would_wait_is_refused_when_the_work_ahead_outlasts_the_timeout():
    backlog = Backlog(timeout_s=60.0)
    backlog.rate.add(100, 10.0)  # 10 tokens/s
    fits = backlog.judge(ahead_tokens=450, own_tokens=100, must_wait=True)
    assert fits.admit and fits.finish_s == pytest.approx(55.0)
    late = backlog.judge(ahead_tokens=700, own_tokens=100, must_wait=True)
    assert not late.admit and late.finish_s == pytest.approx(80.0)
    assert late.retry_after_s == 20  # by then 200 tokens of the work ahead are done, and it fits


def test_a_request_that_starts_at_once_or_before_any_measurement_is_admitted():
    backlog = Backlog(timeout_s=60.0)
    assert backlog.judge(ahead_tokens=10**6, own_tokens=100, must_wait=True).admit  # nothing measured
    backlog.rate.add(100, 10.0)
    assert backlog.judge(ahead_tokens=10**6, own_tokens=100, must_wait=False).admit  # a free slot
    huge = backlog.judge(ahead_tokens=10**6, own_tokens=100, must_wait=True)
    assert not huge.admit and huge.retry_after_s == 60  # never told to wait longer than a timeout


def test_a_budget_is_what_is_left_of_max_new_tokens_and_of_the_context():
    assert budget_left(128, prompt_tokens=20, produced=0, max_position=2048) == 128
    assert budget_left(128, prompt_tokens=20, produced=100, max_position=2048) == 28
    assert budget_left(128, prompt_tokens=2000, produced=10, max_position=2048) == 38
    assert budget_left(128, prompt_tokens=20, produced=200, max_position=2048) == 0
