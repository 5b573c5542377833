"""calid bench placement's live replay on the session's Ray: a plan for two devices over SmolLM2 models is
served as a multi-model app pinned to cores, a short trace is replayed through gRPC, and measured attainment
is reported beside the simulator's for the same requests."""
from __future__ import annotations

import json
import os

import pytest

from calid.models.presets import TEST_MODEL

pytestmark = [pytest.mark.ray, pytest.mark.model]


def test_live_replay_reports_measured_beside_simulated_attainment(serve_port, smol, tmp_path, capsys):
    from serve_app.main import main
    from calid.placement.profile import Config, Latency, ModelProfile, save

    # SmolLM2's one-thread costs, roughly as --profile measures them on these machines (the test checks the
    # replay, not the profile): 10 ms a step at batch 1, 0.2 ms a prompt token
    lat = Latency((1, 2, 4, 8), (0.010, 0.012, 0.016, 0.024), 0.0002)
    path = tmp_path / "profile.json"
    save(path, {TEST_MODEL: ModelProfile(TEST_MODEL, 100 << 20, {Config(1, 1): lat})},
         {"tp_efficiency": 0.4, "pp_overhead": 0.1, "cpu": "test"})
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{10 + i:02d}.0000000,{40 + 7 * i % 50},{4 + 3 * i % 12}\n" for i in range(20)))
    devices = min(2, len(os.sched_getaffinity(0)))
    assert main(["bench", "placement", "--profile-file", str(path), "--trace", str(trace), "--devices", str(devices),
                 "--duration", "6", "--load", "0.3", "--live-plans", "alpaserve,dedicated", "--port", str(serve_port),
                 "--json", "--out", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["planner"]: r for r in out["live"]}
    assert set(rows) == {"alpaserve", "dedicated"}
    for r in rows.values():
        assert r["requests"] == out["meta"]["requests"] > 0 and r["errors"] == 0
        assert 0.0 <= r["measured"] <= 1.0 and 0.0 <= r["simulated"] <= 1.0
        assert TEST_MODEL in r["per_model"]
    assert (tmp_path / "placement-live.md").exists()
    from ray import serve

    assert "placement" not in serve.status().applications  # the app is gone, the session's Ray is not
