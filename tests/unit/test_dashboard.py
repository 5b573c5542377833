"""The shipped Grafana dashboard plots the metrics the app defines (names as Ray exports them)."""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_calid_metric_has_a_panel_and_every_panel_a_metric():
    source = (ROOT / "serve_app/router/metrics.py").read_text()
    defined = set(re.findall(r'"(calid_[a-z_]+)"', source))
    defined |= {f"calid_{role}_{kind}" for role in ("target", "draft") for kind in ("batch_size", "call_ms")}
    dash = json.loads((ROOT / "serve_app/cluster/grafana/calid_dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    used = set(re.findall(r"ray_(calid_[a-z_]+?)(?:_total|_bucket|_sum|_count)?[\[{)\s]", exprs + " "))
    assert defined - used == set(), f"metrics without a panel: {defined - used}"
    assert used - defined == set(), f"panels for metrics that do not exist: {used - defined}"
