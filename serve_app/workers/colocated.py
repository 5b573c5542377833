"""The engine topology: the draft and target workers inside the router's own process.

With ``topology: engine`` the router replica builds both worker deployments' classes itself and calls them
through ``LocalHandle``, which takes the calls a Serve handle takes (``handle.verify.remote(tasks, report,
replica=...)``, ``broadcast``) and runs them as tasks on the router's event loop (the step's draft and verify calls:
awaited directly in the step's task, ``direct``). Everything above the handle
(worker calls and their retries, deltas, pins, the release echo, scoring, calibration) is unchanged; what goes
away is the process hop of every draft and target call: a step costs its forwards and the router's own work.
The models' forwards run on the event loop's own thread, inline
(``run_inline``: llama.cpp slows down for good once two threads have called it).

The split topology (separate draft and target deployments) stays for what one process cannot do: drafts on
other nodes, model-parallel target groups, and scaling draft and target replicas apart.
"""
from __future__ import annotations

import asyncio


class LocalHandle:
    """A worker object in this process behind a Serve deployment handle's call shape. ``direct(method)``: the
    worker's coroutine function itself, for a caller that awaits it in its own task (WorkerCalls: no task
    and no loop iteration per call)."""

    in_process = True

    def __init__(self, worker):
        self.worker = worker

    def direct(self, method: str):
        return getattr(self.worker, method)

    def __getattr__(self, method: str) -> "_LocalMethod":
        if method.startswith("_"):
            raise AttributeError(method)
        return _LocalMethod(getattr(self.worker, method))

    def broadcast(self, method: str) -> "_LocalBroadcast":
        return _LocalBroadcast(self, method)


class _LocalMethod:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args, **kwargs) -> asyncio.Task:
        """The call as a task on the running loop: awaitable, and cancellable like a Serve response."""
        return asyncio.ensure_future(self._fn(*args, **kwargs))


class _LocalBroadcast:
    def __init__(self, handle: LocalHandle, method: str):
        self._handle, self._method = handle, method

    async def results_async(self, return_exceptions: bool = False) -> list:
        try:
            return [await getattr(self._handle, self._method).remote()]
        except Exception as e:
            if return_exceptions:
                return [e]
            raise


def colocated_workers(config: dict) -> tuple[LocalHandle | None, LocalHandle]:
    """(draft or None, target) built in this process from the app config, target first (the draft checks
    its vocabulary against the target's)."""
    from serve_app.workers.deployments import DraftDeployment, TargetDeployment

    target = TargetDeployment.func_or_class(config)
    target.run_inline()  # one thread, the event loop's, calls llama.cpp for both models (see run_inline)
    if config.get("draft") is None:
        return None, LocalHandle(target)
    draft = DraftDeployment.func_or_class(config)
    draft.run_inline()
    return LocalHandle(draft), LocalHandle(target)
