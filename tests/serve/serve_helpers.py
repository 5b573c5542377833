"""Helpers shared by the serve tests."""
from __future__ import annotations

from serve_app.cluster.config import AppConfig


def deploy(cfg: AppConfig):
    from ray import serve

    from serve_app.cluster.app import build_app, wait_calibrated

    serve.run(build_app(cfg), name=cfg.app_name, route_prefix=f"/{cfg.app_name}")
    assert wait_calibrated(cfg), f"{cfg.app_name}: the routers did not time their workers within the wait"
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


class _NoWorkers:
    """Stands for the draft and target handles of a router that only admits and refuses."""

    def options(self, **kw):
        return self


def workerless_router(cfg: AppConfig):
    """An in-process router whose requests never reach a worker (for tests of admission and translation)."""
    from serve_app.router.router import Router

    return Router.func_or_class(cfg.model_dump(), _NoWorkers(), _NoWorkers())


def forget_admitted(router) -> None:
    """Drop what an in-process router admitted before its step loop runs (a router with no workers)."""
    router._requests.clear()
    router._waiting.clear()
    if router._loop_task is not None:
        router._loop_task.cancel()
        router._loop_task = None


# ---- stand-ins for Serve's transport, to drive the router and the workers in process -----------------

class GrpcContext:
    """The parts of Serve's gRPC context the router uses."""

    def __init__(self, metadata=()):
        self.code, self.message, self.metadata = None, None, tuple(metadata)

    def set_code(self, code):
        self.code = code

    def set_details(self, message):
        self.message = message

    def details(self):
        return self.message

    def invocation_metadata(self):
        return self.metadata


class Call:
    """An awaitable worker call with cancel(), as Serve's DeploymentResponse."""

    def __init__(self, coro):
        import asyncio

        self._task = asyncio.ensure_future(coro)
        self.cancelled = False

    def __await__(self):
        return self._task.__await__()

    def cancel(self):
        self.cancelled = True
        self._task.cancel()


class StandIn:
    """Serve's deployment handle in process: ``options(...)`` is ignored and ``.method.remote(*args)``
    runs the coroutine ``self._method(*args)`` (subclasses define them), returning a Call. The ``replica``
    keyword (Serve's routing reads it) is dropped; a method that returns a bare list of results (a worker
    behind no deployment) answers as a Reply naming no replica, so the router sends it full token ids."""

    def options(self, **kw):
        return self

    def sent(self, method: str, call: Call) -> None:
        """Every call made, as the caller holds it (override to record)."""

    async def _cut_runs(self):
        """A target's cut_runs: a stand-in runs each call in one go, so there is no run in progress to cut."""

    def __getattr__(self, method):
        if method.startswith("_"):
            raise AttributeError(method)
        outer = self

        class _Method:
            def remote(self, *args, replica=None):
                call = Call(_as_reply(getattr(outer, f"_{method}")(*args)))
                outer.sent(method, call)
                return call

        return _Method()


async def _as_reply(coro):
    from serve_app.router.calls import Reply

    out = await coro
    return Reply(None, out) if isinstance(out, list) else out
