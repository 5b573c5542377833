"""Target replicas follow load: up when routers report token demand, back down when it stops."""
from __future__ import annotations

import threading

import pytest
from serve_helpers import deploy, wait_until

from calid.client import Client
from serve_app.cluster.config import AppConfig

pytestmark = [pytest.mark.ray, pytest.mark.model]


def _replicas(app: str, deployment: str) -> int:
    from ray import serve

    status = serve.status().applications[app].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


def test_target_scales_up_under_load_and_back_down(serve_port):
    scaling = {"min_replicas": 1, "max_replicas": 2, "tokens_per_replica": 2.0, "upscale_delay_s": 0.0,
               "downscale_delay_s": 2.0, "look_back_period_s": 2.0}
    deploy(AppConfig.small(app_name="scale", grpc_port=serve_port, draft=None, target_scaling=scaling))
    assert _replicas("scale", "target") == 1
    stop, errors, served = threading.Event(), [], []

    def load():
        with Client(f"127.0.0.1:{serve_port}", app="scale", timeout=120) as c:
            while not stop.is_set():
                try:
                    served.append(len(c.generate("Count from one to twenty.", max_new_tokens=24,
                                                 ignore_eos=True).token_ids))
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)
                    return

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        assert wait_until(lambda: _replicas("scale", "target") == 2, 90, 1.0), "no scale-up under load"
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors and served and set(served) == {24}
    assert wait_until(lambda: _replicas("scale", "target") == 1, 90, 1.0), "no scale-down after the load"


def test_scaled_out_replicas_all_get_work_and_routers_share_them(serve_port):
    """Three target replicas behind two routers: every replica serves requests (new ones go to the replica
    with the fewest of a router's requests), each router sends at most one target call per replica and
    step, and every output is the same greedy text."""
    from concurrent.futures import ThreadPoolExecutor

    from serve_helpers import handle

    cfg = deploy(AppConfig.small(app_name="spread", grpc_port=serve_port, draft=None, max_active=8,
                                 target_scaling={"min_replicas": 3, "max_replicas": 3},
                                 router_scaling={"min_replicas": 2, "max_replicas": 2}))
    assert _replicas("spread", "target") == 3 and _replicas("spread", "router") == 2

    def one(_):
        with Client(f"127.0.0.1:{serve_port}", app="spread", timeout=120) as c:
            return list(c.generate("Count from one to twenty.", max_new_tokens=8, ignore_eos=True).token_ids)

    with ThreadPoolExecutor(12) as pool:
        first = list(pool.map(one, range(12)))  # the routers learn the replicas while these run
        outs = list(pool.map(one, range(12)))
    assert all(len(o) == 8 for o in first + outs) and len({tuple(o) for o in first + outs}) == 1
    stats = handle(cfg.app_name, "target").broadcast("stats").results(timeout_s=30)
    assert len(stats) == 3 and all(s["batches"] > 0 for s in stats), stats
    routers = handle(cfg.app_name, "router").broadcast("stats").results(timeout_s=30)
    assert len(routers) == 2
    assert all(r["steps"] > 0 and 1 <= r["target_fanout"] <= 3 for r in routers), routers
    from ray import serve

    serve.delete("spread")
