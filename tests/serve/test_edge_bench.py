"""``calid bench edge`` end to end on SmolLM2 (its own embedded Ray, so in a subprocess): every run
completes and the report holds the ratios it promises."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.model]


def test_bench_edge_small(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "serve_app.main", "bench", "edge", "--small", "--clients", "2",
                           "--max-new-tokens", "12", "--port", "50163", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(next(tmp_path.glob("edge-small*.json")).read_text())
    rows = {(r["mode"], r["drafted"]): r for r in report["rows"]}
    assert set(rows) == {("ar", "-"), ("filter", "cluster"), ("filter", "edge"), ("speculative", "cluster"),
                         ("speculative", "edge")}
    assert all(r["tokens"] == 24 and r["server_cpu_ms_per_tok"] > 0 for r in rows.values())
    assert rows[("ar", "-")]["fwd_vs_ar"] == 1.0 and rows[("ar", "-")]["from_draft"] == 0
    assert rows[("filter", "edge")]["from_draft"] > 0
    assert "speculative at the edge: target work" in proc.stderr
