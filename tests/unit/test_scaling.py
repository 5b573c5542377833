"""Autoscaling: the pure replica arithmetic and the Serve policy on hand-built contexts."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from calid.scaling import RateWindow, desired_replicas, target_demand
from serve_app.router.autoscaling import CalidScalingPolicy, per_router_total


def test_target_demand_shrinks_with_the_filtered_fraction():
    assert target_demand(100.0, 0.0) == 100.0
    assert target_demand(100.0, 0.8) == pytest.approx(20.0)
    assert target_demand(100.0, 1.0) == 0.0


@pytest.mark.parametrize("demand, pending, want", [
    (0.0, 0.0, 0), (7.9, 0, 1), (8.0, 0, 1), (8.1, 0, 2), (0.0, 9, 3), (30.0, 2, 4),
])
def test_desired_replicas(demand, pending, want):
    assert desired_replicas(demand, pending, tokens_per_replica=8.0, queue_per_replica=4.0) == want


def test_rate_window_counts_sources_and_forgets():
    w = RateWindow(window_s=10.0)
    w.add(8, 2, True, now=100.0)
    w.add(0, 10, False, now=105.0)
    snap = w.snapshot(now=106.0)
    assert snap["token_rate"] == pytest.approx(2.0)  # 20 tokens / 10 s
    assert snap["filtered_fraction"] == pytest.approx(0.4)
    assert snap["target_demand"] == pytest.approx(1.2)
    assert snap["draft_demand"] == pytest.approx(1.0)  # only the draft-mode request's 10 tokens
    assert w.snapshot(now=200.0)["token_rate"] == 0.0


def test_rate_window_sums_follow_entries_as_they_leave():
    """The kept sums equal a count over the entries still in the window, entry by entry as old ones leave."""
    w = RateWindow(window_s=10.0)
    entries = [(float(t), t % 3, 2 * t + 1, t % 2 == 0) for t in range(30)]
    for t, d, g, uses in entries:
        w.add(d, g, uses, now=t)
    for now in (29.0, 33.5, 38.0, 39.5, 45.0):
        kept = [e for e in entries if e[0] >= now - 10.0]
        draft, target = sum(e[1] for e in kept), sum(e[2] for e in kept)
        snap = w.snapshot(now=now)
        assert snap["token_rate"] == pytest.approx((draft + target) / 10.0)
        assert snap["filtered_fraction"] == pytest.approx(draft / (draft + target) if kept else 0.0)
        assert snap["draft_demand"] == pytest.approx(sum(e[1] + e[2] for e in kept if e[3]) / 10.0)


def _ctx(metrics, state=None):
    return SimpleNamespace(aggregated_metrics=metrics, policy_state=state or {})


def test_a_router_seen_by_two_replicas_counts_once():
    metrics = {"demand/r1": {"a": 10.0, "b": 9.0}, "demand/r2": {"a": 6.0}, "pending_calls": {"a": 1.0, "b": 0.0}}
    assert per_router_total(metrics, "demand/") == 16.0


def test_policy_scales_on_demand_and_on_queues():
    policy = CalidScalingPolicy(tokens_per_replica=8.0, queue_per_replica=4.0)
    n, state = policy(_ctx({"demand/r1": {"a": 20.0}, "pending_calls": {"a": 0.0}}, {"keep": 1}))
    assert n == 3 and state["keep"] == 1 and state["calid_demand"] == 20.0
    n, _ = policy(_ctx({"demand/r1": {"a": 1.0}, "queue/r1": {"a": 10.0}, "pending_calls": {"a": 2.0}}))
    assert n == 3  # 12 pending / 4 per replica
    n, _ = policy(_ctx({}))
    assert n == 0  # idle: Serve's bounds keep min_replicas
