"""calid bench pareto's arithmetic: served speed-ups paired with ar at the same load, quality on the same items,
stopped segments counted for quality but not speed, the operating point, resumable configurations."""
from __future__ import annotations

import argparse

import pytest

from calid.bench.pareto_report import Segment, app_setting, operating_point, plot, summarize
from calid.errors import CalidError

KINDS = {"humaneval/0": "humaneval", "humaneval/1": "humaneval", "math/0": "math", "math/1": "math"}


def answers(solved: list[bool], tokens: int, drafted: int, texts: list[str]) -> dict:
    return {k: {"tokens": tokens, "drafted": drafted, "text": t, "solved": s}
            for k, s, t in zip(KINDS, solved, texts)}


def seg(config: str, c: int, seconds: float, keys=tuple(KINDS), run: str = "r1") -> Segment:
    return Segment(config, c, run, seconds, tuple(keys))


def test_speed_is_paired_with_ar_at_the_same_load_and_quality_is_per_task():
    got = {("ar", 1): answers([True, True, True, False], 10, 0, ["a", "b", "c", "d"]),
           ("filter t=0.4", 1): answers([True, False, True, False], 10, 8, ["a", "x", "c", "d"]),
           ("ar", 4): answers([True, True, True, False], 10, 0, ["a", "b", "c", "d"]),
           ("filter t=0.4", 4): answers([True, True, True, False], 10, 5, ["a", "b", "c", "d"])}
    segments = [seg("ar", 1, 4.0), seg("filter t=0.4", 1, 2.0), seg("ar", 4, 4.0),
                seg("filter t=0.4", 4, 1.0, keys=("humaneval/0", "humaneval/1")),  # a first segment, then
                seg("filter t=0.4", 4, 1.0, keys=("math/0", "math/1"), run="r2")]  # the rest, resumed later
    rows = summarize(["ar", "filter t=0.4"], [1, 4], KINDS, got, segments, set(), set())
    by = {(r["config"], r["c"], r["task"]): r for r in rows}
    assert by["filter t=0.4", 1, "all"]["speedup_vs_ar"] == pytest.approx(2.0)  # 40 tokens in 2 s vs 4 s
    assert by["filter t=0.4", 1, "humaneval"]["quality"] == 0.5 and by["ar", 1, "humaneval"]["quality"] == 1.0
    assert by["filter t=0.4", 1, "humaneval"]["identical_to_ar"] == "1/2"
    assert by["filter t=0.4", 1, "math"]["identical_to_ar"] == "2/2"
    assert by["filter t=0.4", 1, "all"]["filtered_fraction"] == pytest.approx(0.8)
    assert by["filter t=0.4", 4, "all"]["speedup_vs_ar"] == pytest.approx(2.0)  # both segments: 40 tokens in 2 s
    assert by["filter t=0.4", 4, "all"]["ratio_across_runs"] == "yes" and by["ar", 4, "all"]["ratio_across_runs"] == ""


def test_a_stopped_segment_counts_for_quality_not_for_speed_and_budgets_answer_the_held_out_half():
    held = {"humaneval/1", "math/1"}
    got = {("ar", 1): answers([True, False, True, True], 10, 0, list("abcd")),
           ("min_agreement 0.98", 1): {k: v for k, v in answers([True, True, True, True], 10, 9, list("abcd")).items()
                                       if k in held}}
    rows = summarize(["ar", "min_agreement 0.98"], [1], KINDS, got, [seg("ar", 1, 4.0)], held, {"min_agreement 0.98"})
    by = {(r["config"], r["task"]): r for r in rows}
    budget = by["min_agreement 0.98", "humaneval"]
    assert budget["done"] == "1/1" and budget["speedup_vs_ar"] == "-"  # answered, but its segment never finished
    assert budget["quality"] == 1.0 and budget["ar_quality_same_items"] == 0.0  # ar on the same (held-out) item


def test_the_operating_point_is_the_most_drafted_setting_within_two_points_of_ar():
    rows = [{"config": "ar", "c": 1, "task": "humaneval", "quality": 0.65, "ar_quality_same_items": 0.65,
             "filtered_fraction": 0.0, "done": "164/164", "speedup_vs_ar": 1.0}]
    for name, q, f in (("filter t=0.95", 0.634, 0.87), ("filter t=0.4", 0.55, 0.99), ("filter t=0.9", 0.64, 0.9)):
        rows.append({"config": name, "c": 1, "task": "humaneval", "quality": q, "ar_quality_same_items": 0.65,
                     "filtered_fraction": f, "done": "164/164", "speedup_vs_ar": 1.2})
    assert operating_point(rows, 1)["config"] == "filter t=0.9"
    rows[-1]["done"] = "100/164"  # not every item answered yet: not a point to choose
    assert operating_point(rows, 1)["config"] == "filter t=0.95"
    assert operating_point(rows, 8) is None


def test_a_filter_operating_point_becomes_an_app_setting_that_loads():
    import yaml

    from serve_app.cluster.config import load_config

    setting = app_setting("filter t=0.95")
    assert setting == "filter_threshold: 0.95"
    assert load_config(yaml.safe_load(setting)).filter_point == 0.95  # the line, pasted into an app.yaml
    assert app_setting("rollback nll>2") is None and app_setting("min_agreement 0.98") is None


def test_the_chart_is_written(tmp_path):
    rows = [{"config": n, "c": c, "task": "humaneval", "quality": q, "speedup_vs_ar": x}
            for c in (1, 4) for n, q, x in (("ar", 0.65, 1.0), ("filter t=0.4", 0.55, 1.8))]
    assert plot(rows, "humaneval", tmp_path / "p.png").stat().st_size > 10_000


def test_configurations_cover_every_family_and_refuse_unknown_names():
    from serve_app.bench.pareto import DRAFT_ALONE, configurations

    args = argparse.Namespace(filter_thresholds="0.95,0.4", rollback_nlls="1,4", budgets="0.98", small=False,
                              only=None)
    cfgs = dict(configurations(args))
    assert list(cfgs)[:2] == ["ar", "draft only"] and cfgs["draft only"]["model"] == DRAFT_ALONE
    assert cfgs["filter t=0.95"] == {"mode": "filter", "threshold": 0.95}
    assert cfgs["rollback nll>4"] == {"mode": "rollback", "rollback_nll": 4.0}
    assert cfgs["min_agreement 0.98"] == {"min_agreement": 0.98}
    args.small, args.only = True, "filter t=0.4"
    assert [n for n, _ in configurations(args)] == ["ar", "filter t=0.4"]  # ar always; no draft alone on SmolLM2
    args.only = "filter t=0.5"
    with pytest.raises(CalidError, match="unknown configuration"):
        configurations(args)


def test_the_quality_table_is_read_off_the_calibration_half_and_each_budget_is_checked_on_the_held_out_half():
    from calid.bench.pareto_report import budget_rows, quality_table

    kinds = {f"humaneval/{i}": "humaneval" for i in range(8)} | {"math/0": "math"}
    held = {f"humaneval/{i}" for i in range(1, 8, 2)}

    def run(solved: list[int], drafted: int) -> dict:
        return {f"humaneval/{i}": {"tokens": 10, "drafted": drafted, "text": "", "solved": bool(s)}
                for i, s in enumerate(solved)}

    got = {("ar", 8): run([1, 1, 1, 1, 1, 1, 0, 1], 0),
           ("filter t=0.97", 8): run([1, 1, 1, 1, 1, 1, 0, 1], 5),  # no loss on either half
           ("filter t=0.6", 8): run([0, 1, 0, 1, 0, 1, 0, 1], 9),  # 3 of 4 calibration items lost
           ("filter t=0.9", 8): run([1, 0, 1, 0, 1, 1, 0, 1], 7),  # no calibration loss, 2 of 4 held-out lost
           ("filter t=0.8", 4): run([1] * 8, 8)}  # another concurrency: not read for c = 8
    table = quality_table(got, 8, kinds, held, "test")
    assert [p.threshold for p in table.points] == [0.97, 0.9, 0.6]
    assert [p.loss_points for p in table.points] == [0.0, 0.0, 75.0] and table.points[0].items == 4
    assert table.points[1].filtered_fraction == pytest.approx(0.7)
    rows = {r["budget_points"]: r for r in budget_rows(table, [60.0, 40.0, 1.0], got, 8, kinds, held)}
    # 0.6's 75 +- 33 points is never vouched for, so both budgets stop at 0.9, whose held-out loss is 50 points
    assert rows[60.0]["threshold"] == 0.9 and rows[60.0]["holds"] == "yes"
    assert rows[40.0]["threshold"] == 0.9 and rows[40.0]["holds"] == "no"
    assert rows[60.0]["held_out_loss"].startswith("+50.0") and rows[60.0]["held_out_filtered"] == pytest.approx(0.7)
    assert rows[1.0]["threshold"] == 1.0 and rows[1.0]["holds"] == "yes"  # no threshold vouched for: the target
    assert quality_table(got, 8, kinds, held | {"humaneval/0"}, "test").points[0].items == 3
    assert quality_table({("ar", 8): got["ar", 8]}, 8, kinds, held, "test") is None


def test_the_report_writes_the_quality_table_serving_reads_and_says_whether_each_budget_held(tmp_path):
    import json
    import types

    from calid.bench.quality_curve import Item
    from calid.decoding.quality_budget import QualityTable, table_for
    from serve_app.bench.pareto import _quality_budgets

    work = [Item("humaneval", f"humaneval/{i}", "p", 8, None, i % 2 == 1) for i in range(40)]
    ar = {it.key: {"tokens": 10, "drafted": 0, "text": "", "solved": True} for it in work}
    close = {k: v | {"drafted": 6} for k, v in ar.items()}  # filter t=0.99 solves what ar solves
    results = types.SimpleNamespace(answers={("ar", 8): ar, ("filter t=0.99", 8): close},
                                    meta={"target": "t", "draft": "d"})
    path = tmp_path / "quality.json"
    args = argparse.Namespace(loss_budgets="2,0.1", quality_table=str(path))
    lines = _quality_budgets(args, results, [1, 8], work)
    assert lines[0].startswith("quality table at c=8") and "t=0.99 +0.0 +- 5.0" in lines[0]  # 1 / 20 items
    assert "max_quality_loss 2 (at 90% confidence) -> threshold 1:" in lines[1]  # 0 + 1.28 x 5 > 2: not vouched
    table, source = table_for("t", "d", str(path))
    assert source == str(path) and table == QualityTable.from_json(json.loads(path.read_text()))
    assert table.threshold_for(10) == 0.99 and "at 8 concurrent requests" in table.source
    assert _quality_budgets(args, types.SimpleNamespace(answers={("ar", 8): ar}, meta={}), [8], work)[0].startswith(
        "max_quality_loss: no filter threshold")


def test_the_app_runs_the_topology_calid_serve_runs_and_results_of_another_topology_are_not_resumed(tmp_path):
    import json

    from serve_app.bench.pareto import DRAFT_ALONE, Results, app_config
    from serve_app.main import build_parser

    args = build_parser().parse_args(["bench", "pareto", "--port", "8123"])
    cfg = app_config(args, 8, 50123)
    assert args.topology == "engine" and cfg.topology == "engine" and cfg.max_active == 16
    assert {m.topology for m in cfg.model_configs.values()} == {"engine"}
    assert cfg.model_configs[DRAFT_ALONE].draft is None and cfg.model_configs[DRAFT_ALONE].target == cfg.draft
    assert app_config(build_parser().parse_args(["bench", "pareto", "--topology", "split"]), 4, 1).topology == "split"

    folder = tmp_path / "pareto-qwen"  # results stored before the bench recorded its topology ran on split
    folder.mkdir()
    (folder / "answers.jsonl").write_text(json.dumps({"config": "ar", "c": 8, "key": "humaneval/0"}) + "\n")
    (folder / "meta.json").write_text(json.dumps({"target": "t", "draft": "d"}))
    with pytest.raises(CalidError, match="topology"):
        Results(folder, {"target": "t", "draft": "d", "topology": "engine"}, fresh=False)
    held = Results(folder, {"target": "t", "draft": "d", "topology": "split"}, fresh=False)
    assert list(held.answers) == [("ar", 8)] and json.loads((folder / "meta.json").read_text())["topology"] == "split"
