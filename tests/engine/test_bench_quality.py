"""calid bench quality end to end on SmolLM2 (its first 16 layers as the draft): every configuration runs,
the report and the calibration are written, generating and scoring can be split across runs, and a run
resumes instead of starting over."""
from __future__ import annotations

import json

import pytest

from serve_app.main import main
from calid.decoding.budget import AgreementTable

pytestmark = pytest.mark.model


def test_bench_quality_runs_writes_a_calibration_and_resumes(smol, tmp_path, capsys):
    cal = tmp_path / "agreement.json"
    argv = ["bench", "quality", "--target", "smollm2-135m-instruct", "--draft", "self:16", "--limit", "2",
            "--math", "2", "--mtbench", "2", "--max-new-tokens", "12", "--filter-thresholds", "0.5",
            "--rollback-nlls", "2", "--budgets", "0.9", "--out", str(tmp_path), "--calibration", str(cal)]
    folder = tmp_path / "quality-smollm2-135m-instruct--self_16"
    assert main(argv + ["--no-score"]) == 0  # generate only: no report yet
    assert not (folder / "quality.json").exists()
    assert main(argv + ["--report-only", "--no-score"]) == 0  # a report of what is there, nothing scored
    unscored = json.loads((folder / "quality.json").read_text())["rows"]
    assert {r["token_match"] for r in unscored} == {"-"} and all(r["quality"] != "-" for r in unscored
                                                                 if r["task"] == "humaneval")
    assert main(argv) == 0  # scores what the first run generated
    report = json.loads((folder / "quality.json").read_text())
    rows = {(r["config"], r["task"]): r for r in report["rows"]}
    assert {c for c, _ in rows} == {"ar", "draft only", "filter t=0.5", "rollback nll>2", "min_agreement 0.9"}
    assert rows[("ar", "all")]["done"] == "6/6" and rows[("min_agreement 0.9", "all")]["done"] == "3/3"
    assert rows[("ar", "all")]["filtered_fraction"] == 0.0 and rows[("draft only", "all")]["filtered_fraction"] == 1.0
    assert rows[("ar", "all")]["prefix_agreement"] == 1.0
    assert rows[("ar", "all")]["token_match"] > 0.9  # the target agrees with its own greedy output (near ties aside)
    assert rows[("draft only", "all")]["token_match"] < rows[("ar", "all")]["token_match"]
    assert (folder / "quality.png").stat().st_size > 10_000 and (folder / "quality.md").exists()
    table = AgreementTable.load(cal)  # what serving would read: the draft on ar's outputs of the even half
    data = json.loads(cal.read_text())
    assert data["prompts"] == 3 and data["tokens"] == sum(data["positions"]) > 0
    assert 0.0 < table.agreement_rate < 1.0
    lines = (folder / "results.jsonl").read_text().count("\n")
    capsys.readouterr()
    assert main(argv) == 0  # everything is there: nothing is generated or scored again
    assert (folder / "results.jsonl").read_text().count("\n") == lines
    assert "| ar | all | 6/6 |" in capsys.readouterr().out
