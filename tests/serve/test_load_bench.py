"""``calid bench load`` end to end on SmolLM2 (its own embedded Ray, so in a subprocess): every run completes,
the report holds every mode at every load with ratios to ar, and the plot is written."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from serve_app.bench.load import DEFAULT_TRACE

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.model]


def test_bench_load_small(tmp_path):
    rates = ["--rates", "light,overload"] if DEFAULT_TRACE.is_file() else ["--rates", ""]
    proc = subprocess.run([sys.executable, "-m", "serve_app.main", "bench", "load", "--small",
                           "--modes", "auto,speculative",
                           "--concurrency", "1,2", "--trace-requests", "4", "--max-new-tokens", "6",
                           "--port", "50164", "--out", str(tmp_path), *rates],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "load-small.json").read_text())
    loads = ["c1", "c2"] + (["light", "overload"] if DEFAULT_TRACE.is_file() else [])
    rows = {(r["load"], r["mode"]): r for r in report["rows"]}
    assert set(rows) == {(w, m) for w in loads for m in ("ar", "auto", "speculative")}
    assert all(r["errors"] == 0 and r["tokens"] > 0 for r in rows.values())
    assert all(rows[(w, "ar")]["goodput_vs_ar"] == 1.0 for w in loads if rows[(w, "ar")]["goodput_tok_s"] > 0)
    assert rows[("c1", "speculative")]["draft_share"] > 0 and rows[("c1", "ar")]["draft_share"] == 0
    assert (tmp_path / "load-small.png").stat().st_size > 10_000
    assert re.search(r"^c1 \((goodput|throughput[^)]*)\): auto \d", proc.stderr, re.M), proc.stderr[-2000:]
    assert all(rows[(w, "ar")]["tok_s_vs_ar"] == 1.0 for w in loads)
    # the sweep's chat answers (to EOS) say how much of them copying drafts could find; replays have no chat text
    assert all(0 <= rows[(w, m)]["ngram_share"] <= 1 for w in ("c1", "c2") for m in ("ar", "auto"))
    assert all(rows[(w, "ar")]["ngram_share"] == "-" for w in loads[2:])
