"""Helpers shared by the serve tests."""
from __future__ import annotations

from serve_app.config import AppConfig


def deploy(cfg: AppConfig):
    from ray import serve

    from serve_app.app import build_app

    serve.run(build_app(cfg), name=cfg.app_name, route_prefix=f"/{cfg.app_name}")
    return cfg


def handle(app: str, deployment: str):
    from ray import serve

    return serve.get_deployment_handle(deployment, app)


def wait_until(predicate, timeout_s: float = 30.0, every_s: float = 0.2):
    import time

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    return predicate()
