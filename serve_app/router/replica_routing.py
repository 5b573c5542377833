"""Serve request routing for the worker deployments: a call may name the replica it must reach.

The router pins each request to the worker replica that holds its KV cache and sends one call per replica
per step (serve_app.router.calls). ``PinnedReplicaRouter`` is Serve's power-of-two-choices router, except that a
call with the keyword argument ``replica=<replica id>`` goes to that replica while it is running; a call
naming none, or a replica that is gone, is placed by power of two choices (and the caller re-pins its
requests to whichever replica answered).
"""
from __future__ import annotations

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter


class PinnedReplicaRouter(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(self, candidate_replicas, pending_request=None):
        want = pending_request.kwargs.get("replica") if pending_request is not None else None
        if want:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == want:
                    return [[replica]]
        return await super().choose_replicas(candidate_replicas, pending_request)


def request_router_config():
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(request_router_class=PinnedReplicaRouter)
