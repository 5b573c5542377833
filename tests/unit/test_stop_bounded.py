"""``calid serve`` never hangs on its way out: a Ray shutdown that does not return is ended by a watchdog, and
a router that does not answer how many requests it holds is reported as unknown in time."""
from __future__ import annotations

import threading
import time

import pytest

import serve_app.cluster.local as local
from serve_app.cluster import serve_commands
from serve_app.main import main


def test_a_shutdown_that_never_returns_is_abandoned_after_the_bound(monkeypatch, capsys):
    released, abandoned = threading.Event(), []

    def stuck_shutdown():
        released.wait(30)

    def abandon():  # the real one ends Ray's processes and exits; here it records and lets the shutdown return
        abandoned.append(time.monotonic())
        released.set()

    monkeypatch.setattr(local, "shutdown", stuck_shutdown)
    monkeypatch.setattr(local, "abandon_ray", abandon)
    monkeypatch.setattr(serve_commands, "SHUTDOWN_S", 0.3)
    start = time.monotonic()
    serve_commands._shutdown_bounded()
    assert len(abandoned) == 1 and 0.3 <= abandoned[0] - start < 5
    assert "Ray did not shut down within 0.3 s; ending its processes" in capsys.readouterr().err


def test_a_prompt_shutdown_is_left_alone(monkeypatch):
    abandoned = []
    monkeypatch.setattr(local, "shutdown", lambda: None)
    monkeypatch.setattr(local, "abandon_ray", lambda: abandoned.append(1))
    monkeypatch.setattr(serve_commands, "SHUTDOWN_S", 0.2)
    serve_commands._shutdown_bounded()
    time.sleep(0.4)  # past the bound: the watchdog was cancelled
    assert abandoned == []


def test_a_router_that_never_answers_is_unknown_in_time(monkeypatch):
    from ray import serve

    monkeypatch.setattr(serve, "get_deployment_handle", lambda *a, **k: time.sleep(30))
    start = time.monotonic()
    assert serve_commands._in_flight("calid", timeout_s=0.3) is None
    assert time.monotonic() - start < 5


def test_the_demo_stops_through_the_bounded_shutdown(monkeypatch):
    stopped = []

    def no_ray(*args, **kwargs):
        raise RuntimeError("no Ray here")

    monkeypatch.setattr(local, "serve_app", no_ray)
    monkeypatch.setattr(serve_commands, "_shutdown_bounded", lambda: stopped.append(True))
    with pytest.raises(RuntimeError, match="no Ray here"):
        main(["demo"])
    assert stopped == [True]


def test_once_stopping_rays_own_threads_fail_quietly_and_any_other_thread_still_prints(monkeypatch):
    """A signal to the whole process group ends Ray's processes too; its driver thread that prints the workers'
    logs then failed with an RpcError traceback after calid's one line (seen in the suite)."""
    printed = []
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(args.thread.name))

    def fail():
        raise RuntimeError("failed to connect to all addresses")

    def run(name):
        t = threading.Thread(target=fail, name=name)
        t.start()
        t.join()

    run("ray_print_logs")
    assert printed == ["ray_print_logs"]  # before a stop signal: printed as ever
    serve_commands._quiet_ray_threads()
    quiet = threading.excepthook
    serve_commands._quiet_ray_threads()
    assert threading.excepthook is quiet  # a second signal wraps nothing more
    run("ray_print_logs")
    run("calid-target")
    assert printed == ["ray_print_logs", "calid-target"]
