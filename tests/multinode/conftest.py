"""cluster.yaml's node types started as real Ray nodes on this machine, with the cluster's Serve config
(serve_app/cluster/calid_cluster.yaml) deployed on them as `serve deploy` would, models swapped for SmolLM2.

One cluster for the package: a head, two draft_cpu and two target_gpu nodes (one of each to lose while the
other carries on). CPU counts are scaled by CPU_SCALE (the app's CPU asks too); GPUs are Ray resources with
no device behind them, so which replica fits on which node is as on the real cluster. These tests need their
own Ray: they run before tests/serve starts its single-node session (pytest collects tests/multinode first).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mn_helpers import CPU_SCALE, ROOT, WORKERS

HERE = Path(__file__).parent
_UP: list = []  # the running cluster, at most one


@pytest.fixture(scope="session")
def cluster():
    """Started by the first test here, shut down after the last (pytest_runtest_teardown below): a
    "package" scope does not end with a directory that is not a Python package, and tests/serve, which
    runs next, must find no Ray running."""
    import ray

    if ray.is_initialized():
        pytest.fail("the multinode tests start their own Ray cluster: run them alone (pytest -m multinode) or "
                    "before tests/serve")
    from ray import serve

    from serve_app.cluster.app import grpc_options
    from serve_app.cluster.local import free_port
    from serve_app.cluster.local_cluster import LocalCluster

    c = LocalCluster(ROOT / "cluster.yaml", CPU_SCALE).start(WORKERS)
    _UP.append(c)
    c.grpc_port = free_port()
    doc = yaml.safe_load((ROOT / "serve_app/cluster/calid_cluster.yaml").read_text())
    serve.start(proxy_location=doc["proxy_location"], grpc_options=grpc_options(c.grpc_port),
                http_options={"host": "127.0.0.1", "port": free_port()})
    return c


def _shut_down() -> None:
    from ray import serve

    c = _UP.pop()
    try:
        serve.shutdown()
    finally:
        c.shutdown()


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    """The cluster goes when the next test is not one of these (or there is none)."""
    if _UP and (nextitem is None or Path(nextitem.path).parent != HERE):
        _shut_down()


def pytest_sessionfinish(session):
    if _UP:  # interrupted mid-directory
        _shut_down()


@pytest.fixture(autouse=True)
def _restore(cluster):
    """A test's apps go when it ends (they hold the nodes' GPUs, which the next test's placement counts on),
    and nodes a test lost are replaced, so that one failure does not fail the tests after it."""
    yield
    from ray import serve

    for name in serve.status().applications:
        serve.delete(name)
    for type_name, count in WORKERS.items():
        while len(cluster.nodes.get(type_name, [])) < count:
            cluster.add(type_name)
