"""Target replicas follow load: up when routers report token demand, back down when it stops."""
from __future__ import annotations

import threading

import pytest
from serve_helpers import deploy, wait_until

from calid.client import Client
from serve_app.config import AppConfig

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
