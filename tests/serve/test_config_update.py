"""``calid serve --config app.yaml`` and SIGHUP: a changed file is applied to the running server in place.
Streams in flight finish, requests sent during the switch are all served, new requests see the new config; a
file that cannot be applied is said in one line and the server goes on as it was."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
from test_lifecycle import CALID, _free_port, _user_env, _wait_ready

from calid.client import Client
from calid.client.errors import InvalidArgument

pytestmark = [pytest.mark.ray, pytest.mark.model]

PROMPT = "Count from 1 to 100, one number per line."
LONG = 400  # tokens of each stream in flight: it outlives the start of the new replica


class _Lines:
    """A process's stderr, read on a thread, so that a test can wait for a line."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream):
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout_s: float = 300) -> str:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            found = [ln for ln in self.lines if text in ln]
            if found:
                return found[-1]
            time.sleep(0.2)
        raise AssertionError(f"no line with {text!r} in:\n" + "\n".join(self.lines[-40:]))


def test_sighup_applies_a_changed_config_in_place_with_nothing_refused_or_lost(tmp_path):
    app = tmp_path / "app.yaml"
    app.write_text("max_new_tokens_limit: 4096\nqueue_capacity: 64\n")
    port = _free_port()
    proc = subprocess.Popen([CALID, "serve", "--small", "--draft", "none", "--config", str(app), "--port", str(port),
                             "--http-port", "0", "--no-dashboard"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_user_env(),
                            start_new_session=True)
    err = _Lines(proc.stderr)
    try:
        _wait_ready(port, proc, "", timeout_s=300)
        err.wait_for(f"kill -HUP {proc.pid}")
        address = f"127.0.0.1:{port}"
        streams: dict[int, list[int]] = {}
        ended: list[float] = []
        started = threading.Barrier(4)
        during: list[str] = []  # outcome of each request sent while the update runs
        served_at: list[float] = []
        switching = threading.Event()

        def stream(i):
            with Client(address, timeout=600) as c:
                ids = []
                for chunk in c.stream(PROMPT, max_new_tokens=LONG, ignore_eos=True):
                    if not ids:
                        started.wait(120)
                    ids += chunk.token_ids
                streams[i] = ids
                ended.append(time.monotonic())

        def meanwhile():
            with Client(address, timeout=600) as c:
                while switching.is_set():
                    try:
                        during.append(f"ok {len(c.generate('Say hi.', max_new_tokens=4).token_ids)}")
                        served_at.append(time.monotonic())
                    except Exception as e:  # every outcome is kept: the test asserts there is no other kind
                        during.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        started.wait(300)  # three streams are decoding on the replica the update replaces
        switching.set()
        poller = threading.Thread(target=meanwhile)
        poller.start()
        app.write_text("max_new_tokens_limit: 100\nqueue_capacity: 64\n")
        os.kill(proc.pid, signal.SIGHUP)
        hup = time.monotonic()
        assert "max_new_tokens_limit 4096 -> 100" in err.wait_for("applying")
        err.wait_for(f"applied {app}", timeout_s=300)
        applied = time.monotonic()
        for t in threads:
            t.join(600)
        switching.clear()
        poller.join(120)

        assert sorted(streams) == [0, 1, 2] and all(len(ids) == LONG for ids in streams.values())
        assert during and all(x == "ok 4" for x in during), during
        # the streams ran on the replica being replaced while new requests were served beside them (a replica
        # that stops takes no new request): they outlived the switch, they did not end before it
        assert any(hup + 5 < t < min(ended) for t in served_at), ([t - hup for t in served_at],
                                                                  [t - hup for t in ended], applied - hup)
        with Client(address, timeout=120, retries=0) as c:  # the new config holds for new requests
            with pytest.raises(InvalidArgument, match="100"):
                c.generate("Say hi.", max_new_tokens=150)
            assert len(c.generate("Say hi.", max_new_tokens=8, ignore_eos=True).token_ids) == 8

        # a file that cannot be applied: one line, and the server goes on with what it has
        app.write_text("max_new_tokens_limit: [\n")
        os.kill(proc.pid, signal.SIGHUP)
        assert "not valid YAML" in err.wait_for("not applied", timeout_s=60)
        app.write_text(f"max_new_tokens_limit: 100\ngrpc_port: {_free_port()}\n")  # --port wins over the file
        os.kill(proc.pid, signal.SIGHUP)
        err.wait_for("unchanged; nothing to apply (grpc_port: set by flags, which win over the file)", timeout_s=60)
        app.write_text("max_new_tokens_limit: 100\nroute_prefix: /elsewhere\n")  # the proxies' routes: a restart
        os.kill(proc.pid, signal.SIGHUP)
        err.wait_for("route_prefix change only on a restart", timeout_s=60)
        with Client(address, timeout=120, retries=0) as c:
            assert len(c.generate("Say hi.", max_new_tokens=8, ignore_eos=True).token_ids) == 8

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = "\n".join(err.lines)
    assert "Traceback" not in text, text[-3000:]
