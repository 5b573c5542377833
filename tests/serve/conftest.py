"""One real local Ray + Serve (gRPC proxy on loopback) for the whole serve suite.

App ``calid``: SmolLM2-135M target with its first 16 layers as the draft
(AppConfig.small). Other apps are added by the tests that need other limits.
"""
from __future__ import annotations

import socket

import pytest

from serve_app.cluster.config import AppConfig
from serve_helpers import deploy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve_port():
    from ray import serve

    from serve_app.cluster.app import grpc_options
    from serve_app.cluster.local import LOOPBACK_ENV, shutdown, start_ray

    import os
    os.environ["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "1"
    os.environ["RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "1"
    assert LOOPBACK_ENV
    start_ray(num_cpus=8, dashboard=False)
    port = _free_port()
    HTTP["port"] = _free_port()
    serve.start(grpc_options=grpc_options(port), http_options={"host": "127.0.0.1", "port": HTTP["port"]})
    yield port
    shutdown()


HTTP = {}  # the session's HTTP proxy port

SESSION_APPS = {"calid"}


@pytest.fixture(autouse=True, scope="module")
def _delete_the_modules_apps():
    """Each module's apps go when the module ends: the session's 8 CPUs are shared by every app deployed,
    and an app left behind holds its replicas' CPUs until a later module's deploy cannot be placed."""
    yield
    import ray

    if not ray.is_initialized():
        return
    from ray import serve

    for name in set(serve.status().applications) - SESSION_APPS:
        serve.delete(name)


@pytest.fixture(scope="session")
def http_port(serve_port):
    return HTTP["port"]


# the session app's quality table (max_quality_loss): filter's loss in points per threshold, made up for the tests
# (tests/serve/test_quality_budget.py reads the thresholds budgets resolve to off it)
QUALITY_POINTS = ((0.9, 0.0, 0.5), (0.5, 3.0, 1.0), (0.2, 20.0, 2.0))


@pytest.fixture(scope="session")
def small_app(serve_port, tmp_path_factory):
    import json

    from calid.decoding.quality_budget import LossPoint, QualityTable

    table = tmp_path_factory.mktemp("quality") / "quality.json"
    table.write_text(json.dumps(QualityTable(tuple(LossPoint(*p, 40) for p in QUALITY_POINTS)).to_json()))
    # fp32: the draft's confidences then match the in-process engine's exactly (bf16 on torch may round
    # differently in another process), so filter-mode statistics compare exactly
    return deploy(AppConfig.small(app_name="calid", grpc_port=serve_port, dtype="fp32", quality_table=str(table)))


@pytest.fixture(scope="session")
def base_url(small_app, http_port):
    """The OpenAI base URL of the session's app (route prefix /calid)."""
    return f"http://127.0.0.1:{http_port}/{small_app.app_name}/v1"


@pytest.fixture()
def client(small_app):
    from calid.client import Client

    with Client(f"127.0.0.1:{small_app.grpc_port}", app=small_app.app_name, timeout=300) as c:
        yield c
