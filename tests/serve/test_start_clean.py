"""``calid serve`` starts clean whatever an earlier Ray left behind, and says in one line what it met: a stale
record of a dead cluster (a Ray killed with kill -9), a leftover session directory, a port in use, a cluster
asked for that does not answer; a signal while it is still starting stops it cleanly."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from test_lifecycle import CALID, _alive, _free_port, _user_env, _wait_ready

pytestmark = [pytest.mark.ray, pytest.mark.model]

SMALL = ["serve", "--small", "--draft", "none", "--no-dashboard", "--http-port", "0"]


def _dead_address() -> str:
    """host:port where nothing listens (a port just freed)."""
    return f"127.0.0.1:{_free_port()}"


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("calid: error:")]


def _serve_then_sigterm(ready, env: dict | None = None, group: bool = False) -> tuple[int, str, list[int], float]:
    """Start ``calid serve`` (SmolLM2, no draft), call ``ready(proc, port)`` until it has what it waits for (it
    returns the pids to watch), SIGTERM the server (its whole process group with ``group``) and wait for it: (exit
    code, stderr, the watched pids, seconds from the signal to the exit)."""
    port = _free_port()
    proc = subprocess.Popen([CALID, *SMALL, "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env or _user_env(), start_new_session=True)
    try:
        family = ready(proc, port)
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        t = time.monotonic()
        rc = proc.wait(120)
        took = time.monotonic() - t
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return rc, proc.stderr.read(), family, took


def _serving(proc, port) -> list[int]:
    _wait_ready(port, proc, "", timeout_s=240)
    return [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]


def _ray_started(proc, port) -> list[int]:
    """Ray's GCS runs (the start is under way, the app not yet serving); Ray's processes so far."""
    family: set[int] = set()
    end = time.monotonic() + 120
    while time.monotonic() < end:
        kids = psutil.Process(proc.pid).children(recursive=True)
        family |= {c.pid for c in kids}
        if any("gcs_server" in c.name() for c in kids):
            time.sleep(1.0)
            return sorted(family | {c.pid for c in psutil.Process(proc.pid).children(recursive=True)})
        time.sleep(0.2)
    pytest.fail("Ray did not start")


@pytest.fixture()
def ray_tmp():
    """A Ray temp folder of this test's own (RAY_TMPDIR): short, since Ray's socket paths live under it."""
    folder = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=False)


def test_a_stale_record_and_a_leftover_session_get_one_line_and_a_working_start(ray_tmp):
    """What a Ray killed with kill -9 leaves: its record names a GCS that is gone, its session folder stays.
    Ray's own ray.init() would try to join that dead cluster and wait on it for minutes."""
    ray_dir = ray_tmp / "ray"
    session = ray_dir / "session_2026-01-01_00-00-00_000000_4242"
    (session / "logs").mkdir(parents=True)
    (session / "sockets").mkdir()
    (ray_dir / "session_latest").symlink_to(session)
    dead = _dead_address()
    (ray_dir / "ray_current_cluster").write_text(dead)
    rc, err, family, _ = _serve_then_sigterm(_serving, env={**_user_env(), "RAY_TMPDIR": str(ray_tmp)})
    assert rc == 0, err[-3000:]
    said = [ln for ln in err.splitlines() if "ignoring" in ln]
    assert len(said) == 1 and dead in said[0] and "no longer answers" in said[0], err[-3000:]
    assert "Traceback" not in err
    time.sleep(2)
    assert _alive(family) == []


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_cluster_asked_for_that_does_not_answer_is_one_line_within_seconds(how):
    dead = _dead_address()
    argv, env = [CALID, *SMALL, "--port", str(_free_port())], _user_env()
    if how == "flag":
        argv += ["--address", dead]
    else:
        env["RAY_ADDRESS"] = dead
    t = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    took = time.monotonic() - t
    assert out.returncode == 2, out.stderr[-3000:]
    assert _error_lines(out.stderr) == [
        f"calid: error: no Ray cluster answers at {dead} (from --address or RAY_ADDRESS) within 3 s; start it, or "
        "drop the address to run an embedded Ray"]
    assert "Traceback" not in out.stderr
    assert took < 30  # the CLI's own start-up (imports, config) plus one 3 s probe


@pytest.mark.parametrize("which", ["grpc", "http"])
def test_a_port_in_use_is_refused_in_one_line_naming_the_flag(which):
    grpc_port, http_port = _free_port(), _free_port()
    taken = grpc_port if which == "grpc" else http_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        out = subprocess.run([CALID, "serve", "--small", "--draft", "none", "--no-dashboard", "--port", str(grpc_port),
                              "--http-port", str(http_port)], capture_output=True, text=True, timeout=120,
                             env=_user_env())
    assert out.returncode == 2, out.stderr[-3000:]
    flag = "--port" if which == "grpc" else "--http-port (0 turns HTTP off)"
    what = "gRPC" if which == "grpc" else "HTTP"
    assert _error_lines(out.stderr) == [
        f"calid: error: {what} port {taken} on 127.0.0.1 is in use by another program; choose another with {flag}"]


def test_a_signal_while_starting_stops_cleanly_with_no_process_left():
    """SIGTERM after Ray is up but before the app serves: exit 0, one line, no Ray process left, no native
    stack dump (Ray's own SIGTERM handler used to end it with exit 134)."""
    rc, err, family, _ = _serve_then_sigterm(_ray_started)
    assert rc == 0, err[-3000:]
    assert "SIGTERM while starting: no request had been admitted, none dropped" in err, err[-3000:]
    assert "SIGTERM received" not in err and "Traceback" not in err, err[-3000:]
    time.sleep(2)
    assert _alive(family) == []


def test_a_signal_to_the_whole_process_group_exits_at_once():
    """systemd's stop or `kill -- -PGID` sends SIGTERM to Ray's processes too: calid says so and exits 0 at once,
    instead of waiting a minute on a GCS that is gone and ending with Ray's "The program will terminate"."""
    rc, err, family, took = _serve_then_sigterm(_serving, group=True)
    assert rc == 0, err[-3000:]
    assert "the signal ended Ray's own processes too" in err and "Failed to connect to GCS" not in err, err[-3000:]
    assert took < 20
    time.sleep(2)
    assert _alive(family) == []


def test_a_second_signal_while_draining_stops_at_once_saying_what_was_dropped():
    """SIGTERM drains; a second SIGTERM while a stream is still in flight stops now: one line naming the request
    dropped (it ends UNAVAILABLE, not cut mid-air), exit 0, no Ray process left, no traceback."""
    from calid.client import Client
    from calid.client.errors import Unavailable

    port = _free_port()
    proc = subprocess.Popen([CALID, *SMALL, "--port", str(port), "--drain-grace-s", "600"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_user_env(), start_new_session=True)
    outcome = []
    try:
        family = _serving(proc, port)
        with Client(f"127.0.0.1:{port}", timeout=300, retries=0) as c:
            stream = c.stream("Count to a thousand.", max_new_tokens=4000, ignore_eos=True)
            next(stream)
            proc.send_signal(signal.SIGTERM)
            time.sleep(3)  # draining: the stream goes on
            assert next(stream).token_ids
            proc.send_signal(signal.SIGTERM)
            try:
                for _ in stream:
                    pass
                outcome.append("finished")
            except Unavailable as e:
                outcome.append(str(e))
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = proc.stderr.read()
    assert rc == 0, err[-3000:]
    assert "a second SIGTERM: stopping now; 1 request in flight ends UNAVAILABLE" in err, err[-3000:]
    assert outcome and "stopped before this request finished" in outcome[0], outcome
    assert "Traceback" not in err and "Logging error" not in err, err[-3000:]
    time.sleep(2)
    assert _alive(family) == []
