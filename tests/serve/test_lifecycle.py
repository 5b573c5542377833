"""``calid serve`` as an operator runs it: SIGTERM drains (requests in flight finish, new ones are turned
away), Ray shuts down with no process left behind, exit 0; a start-up failure is one line."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from calid.client import Client, Unavailable

pytestmark = [pytest.mark.ray, pytest.mark.model]

CALID = str(Path(sys.executable).with_name("calid"))
MODEL = "smollm2-135m-instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, proc: subprocess.Popen, tls: str, timeout_s: float = 300) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        assert proc.poll() is None, proc.stderr.read()
        try:
            with Client(f"localhost:{port}", timeout=5, retries=0, tls=tls) as c:
                if c.health().serving:
                    return
        except Exception:
            time.sleep(1)
    raise AssertionError("calid serve did not come up")


def _user_env() -> dict:
    """The environment of a user's shell: none of the Ray settings the test session itself sets."""
    from serve_app.cluster.local import LOOPBACK_ENV

    return {k: v for k, v in os.environ.items() if k not in LOOPBACK_ENV and k != "RAY_ADDRESS"}


def _alive(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out


# long enough that no stream ends between its first chunk and the drain's count (a fast CPU decodes 40 tokens of
# SmolLM2 in well under the second the signal takes to reach the drain)
LONG = 240


def test_sigterm_drains_in_flight_requests_and_leaves_no_process(self_signed):
    """Two models served over TLS (the front of serve_app.ingress.tls) and over HTTP through the multi-model
    front, so the whole path is the one an operator runs."""
    cert, key = self_signed
    tls = str(cert)
    port, http_port = _free_port(), _free_port()
    proc = subprocess.Popen(
        [
            CALID,
            "serve",
            "--models",
            f"small={MODEL},other={MODEL}",
            "--port",
            str(port),
            "--no-dashboard",
            "--http-port",
            str(http_port),
            "--drain-grace-s",
            "120",
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_user_env(),
        start_new_session=True,
    )
    try:
        _wait_ready(port, proc, tls)
        children = psutil.Process(proc.pid).children(recursive=True)
        family = [c.pid for c in children]
        assert family, "Ray's processes should be the server's children"
        (gcs,) = [c for c in children if "gcs_server" in c.name()]
        assert "--node-ip-address=127.0.0.1" in gcs.cmdline()  # Ray on loopback, as in the tests
        results, first_chunk = {}, threading.Barrier(5)
        base_url = f"http://127.0.0.1:{http_port}/v1"

        def stream(i):
            with Client(f"localhost:{port}", timeout=300, tls=tls) as c:
                ids, started = [], False
                for chunk in c.stream(f"Count from {i} to {i + 40}.", max_new_tokens=LONG, ignore_eos=True,
                                      model=("small", "other")[i % 2]):
                    ids += chunk.token_ids
                    if not started:
                        started = True
                        first_chunk.wait(60)
                results[i] = ids

        def http_stream():  # the same drain holds for the OpenAI front-end
            with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300) as c:
                started = False
                for chunk in c.completions.create(model="other", prompt="Count to fifty:",
                                                  max_tokens=LONG, stream=True, extra_body={"ignore_eos": True},
                                                  stream_options={"include_usage": True}):
                    if chunk.usage is not None:
                        results["http"] = chunk.usage.completion_tokens
                    if not started:
                        started = True
                        first_chunk.wait(60)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)] + [
            threading.Thread(target=http_stream)
        ]
        for t in threads:
            t.start()
        first_chunk.wait(120)  # all three are decoding
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        with Client(f"localhost:{port}", timeout=30, retries=0, tls=tls) as c:
            with pytest.raises(Unavailable, match="shutting down"):
                c.generate("Are you there?", max_new_tokens=4)
        refused = httpx.post(f"{base_url}/completions", json={"prompt": "Are you there?", "max_tokens": 4}, timeout=30)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        for t in threads:
            t.join(240)
        rc = proc.wait(240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err, out = proc.stderr.read(), proc.stdout.read()
    assert rc == 0, err[-3000:]
    # Ray tells the driver of a failed task on stdout: Serve's own shutdown used to leave one at every exit
    assert "failed" not in out, out[-3000:]
    assert results.pop("http") == LONG
    assert sorted(results) == [0, 1, 2] and all(len(ids) == LONG for ids in results.values())
    assert "SIGTERM: draining" in err and "4 in flight" in err and "serving gRPC over TLS" in err
    assert f"OpenAI-compatible API: {base_url}" in err
    assert "Traceback" not in err and "Fatal Python error" not in err
    time.sleep(2)
    assert _alive(family) == []


def test_a_start_up_failure_is_one_line(tmp_path):
    empty = tmp_path / "keys"
    empty.write_text("")
    out = subprocess.run([CALID, "serve", "--small", "--no-dashboard", "--port", str(_free_port()),
                          "--api-keys-file", str(empty)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("calid: error:")]
    assert lines == [f"calid: error: no API key found in file {empty}; add one or remove api_keys_file/api_keys_env"]
    assert "Traceback" not in out.stderr
