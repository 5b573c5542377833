"""cluster.yaml's node types started as real Ray nodes on this machine, with the cluster's Serve config
(serve_app/calid_cluster.yaml) deployed on them as `serve deploy` would, models swapped for SmolLM2.

One cluster for the package: a head, two draft_cpu and two target_gpu nodes (one of each to lose while the
other carries on). CPU counts are scaled by CPU_SCALE (the app's CPU asks too); GPUs are Ray resources with
no device behind them, so which replica fits on which node is as on the real cluster. These tests need their
own Ray: they run before tests/serve starts its single-node session (pytest collects tests/multinode first).
"""
from __future__ import annotations

import pytest
import yaml
from mn_helpers import CPU_SCALE, ROOT, WORKERS


@pytest.fixture(scope="package")
def cluster():
    import ray

    if ray.is_initialized():
        pytest.fail("the multinode tests start their own Ray cluster: run them alone (pytest -m multinode) or "
                    "before tests/serve")
    from ray import serve

    from serve_app.app import grpc_options
    from serve_app.local import free_port
    from serve_app.local_cluster import LocalCluster

    c = LocalCluster(ROOT / "cluster.yaml", CPU_SCALE).start(WORKERS)
    c.grpc_port = free_port()
    doc = yaml.safe_load((ROOT / "serve_app/calid_cluster.yaml").read_text())
    serve.start(proxy_location=doc["proxy_location"], grpc_options=grpc_options(c.grpc_port),
                http_options={"host": "127.0.0.1", "port": free_port()})
    try:
        yield c
    finally:
        serve.shutdown()
        c.shutdown()


@pytest.fixture(autouse=True)
def _delete_the_tests_apps():
    """A test's apps go when it ends: they hold the nodes' GPUs, which the next test's placement counts on."""
    yield
    import ray

    if ray.is_initialized():
        from ray import serve

        for name in serve.status().applications:
            serve.delete(name)
