"""Custom Serve autoscaling for the draft and target deployments.

Routers attach their load report (token rate, filtered fraction, admission
queue) to every worker call; each worker replica keeps the latest report per
router and exposes it through ``record_autoscaling_stats`` as
``demand/<router>`` and ``queue/<router>``, next to its own ``pending_calls``.
The policy below turns those metrics into a replica count with
calid.scaling.desired_replicas; Serve applies min/max replicas and the
up/down-scale delays around it.
"""
from __future__ import annotations

from typing import Any

from calid.scaling import desired_replicas

DEMAND, QUEUE, PENDING = "demand/", "queue/", "pending_calls"


def per_router_total(metrics: dict[str, dict[Any, float]], prefix: str) -> float:
    """Sum over routers of what they reported; a router that called several replicas counts once (max)."""
    return sum(max(by_replica.values(), default=0.0) for name, by_replica in metrics.items() if name.startswith(prefix))


class CalidScalingPolicy:
    """Serve autoscaling policy (``AutoscalingPolicy(policy_function=CalidScalingPolicy, policy_kwargs=...)``)."""

    def __init__(self, tokens_per_replica: float, queue_per_replica: float):
        self.tokens_per_replica = tokens_per_replica
        self.queue_per_replica = queue_per_replica

    def __call__(self, ctx) -> tuple[int, dict]:
        metrics = ctx.aggregated_metrics or {}
        demand = per_router_total(metrics, DEMAND)
        pending = sum(metrics.get(PENDING, {}).values()) + per_router_total(metrics, QUEUE)
        n = desired_replicas(demand, pending, self.tokens_per_replica, self.queue_per_replica)
        state = dict(ctx.policy_state)
        state.update(calid_demand=demand, calid_pending=pending, calid_desired=n)
        return n, state


def autoscaling_config(scaling) -> dict:
    """Serve ``autoscaling_config`` for one worker deployment from its ScalingConfig."""
    from ray.serve.config import AutoscalingPolicy

    return {
        "min_replicas": scaling.min_replicas,
        "max_replicas": scaling.max_replicas,
        "initial_replicas": max(1, scaling.min_replicas),
        "upscale_delay_s": scaling.upscale_delay_s,
        "downscale_delay_s": scaling.downscale_delay_s,
        "look_back_period_s": scaling.look_back_period_s,
        "policy": AutoscalingPolicy(
            policy_function=CalidScalingPolicy,
            policy_kwargs={"tokens_per_replica": scaling.tokens_per_replica,
                           "queue_per_replica": scaling.queue_per_replica},
        ),
    }
