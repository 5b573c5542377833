"""``calid bench soak`` end to end on SmolLM2, shortened (its own embedded Ray, so in a subprocess): traffic of
every kind is sent, a draft and a target replica are killed, nothing is lost, the server ends idle, and the
report (JSON, PNG) holds it all."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.model]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bench_soak_small(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "serve_app.main", "bench", "soak", "--small", "--duration", "75s",
                           "--kill-every", "25s", "--burst-every", "30s", "--prompts", "2", "--users", "3",
                           "--port", str(_free_port()), "--http-port", str(_free_port()), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (report,) = tmp_path.glob("soak-*.json")
    data = json.loads(report.read_text())
    counts = data["counts"]
    assert counts["served"] > 0 and counts["tokens"] > 0
    assert counts["lost_tokens"] == 0 and counts["failed_outside_kill_windows"] == 0, counts
    assert counts["not_identical_past_a_near_tie"] == 0, data["mismatches"]  # only near-ties may flip
    assert counts["refused"].get("RESOURCE_EXHAUSTED", 0) > 0  # the burst went over the admission limit
    assert [role for _, role in data["kills"]] == ["draft", "target"]
    assert data["idle"] and all(v == 0 for v in data["idle"].values()), data["idle"]
    assert "verdict: PASS" in proc.stdout
    assert len(list(tmp_path.glob("soak-*.png"))) == 1
    if sys.platform == "linux":  # private anonymous memory, apart from pages of programs read in
        assert data["anon"].keys() == data["rss"].keys()
        assert all(a <= r for k in data["rss"] for (_, a), (_, r) in zip(data["anon"][k], data["rss"][k]))
