"""Where a request for a model placed on several device groups goes: AlpaServe's dispatch, as the simulator
does it (calid.placement.simulator) and the multi-model app's front does it live (serve_app.ingress.multi_model).

A request goes to the replica of its model whose devices have the fewest requests in flight over *every*
model they host, not only its own: two models co-located on one core share its time, so a replica beside a
busy model is slower than an idle one elsewhere though its own queue is as short.
"""
from __future__ import annotations

from typing import Sequence


def least_loaded(candidates: Sequence[int], in_flight: Sequence[int], devices: Sequence[frozenset]) -> int:
    """The candidate replica (an index into ``in_flight`` and ``devices``) whose devices carry the fewest
    requests in flight across all replicas sharing a device with it; ties go to the one with the fewest of
    its own, then the lowest index. A replica with no devices listed (placed anywhere) counts its own only."""
    def device_load(i: int) -> int:
        if not devices[i]:
            return in_flight[i]
        return sum(n for n, d in zip(in_flight, devices) if d & devices[i])

    return min(candidates, key=lambda i: (device_load(i), in_flight[i], i))
