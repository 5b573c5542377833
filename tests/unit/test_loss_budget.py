"""max_quality_loss: a budget in task points turned into filter's threshold by a walk over measured losses that
stops at the first threshold it cannot vouch for; refused clearly where it cannot be served."""
from __future__ import annotations

import argparse
import json

import pytest

from calid.decoding.modes import DecodeParams
from calid.decoding.quality_budget import (LossPoint, QualityTable, budget_decoding, budget_mode, check_budget,
                                           paired_loss, quality_path, resolve_threshold, table_for)
from calid.errors import CalidError, InvalidRequestError, UncalibratedError


def point(t: float, loss: float, se: float) -> LossPoint:
    return LossPoint(t, loss, se, 82)


TABLE = QualityTable((point(0.97, 0.0, 1.0), point(0.9, 1.0, 1.5), point(0.6, 6.0, 2.0), point(0.4, 1.0, 1.0)))


def test_the_paired_loss_counts_items_ar_solved_and_filter_did_not_minus_the_reverse():
    ar = [True, True, False, True, False, True, True, True, True, True]
    filt = [True, False, True, False, False, True, True, True, True, True]  # lost 2 (items 1, 3), won 1 (item 2)
    p = paired_loss(0.9, ar, filt, 0.8)
    assert p.loss_points == pytest.approx(10.0) and p.items == 10 and p.filtered_fraction == 0.8
    # variance of d in {1, -1, 0}: E[d^2] - E[d]^2 with one discordant item more than the 3 seen
    assert p.se_points == pytest.approx(100 * ((4 / 10 - 0.01) / 10) ** 0.5)
    same = paired_loss(0.99, ar, ar)
    assert same.loss_points == 0 and same.se_points > 0  # no difference seen is not certainty
    with pytest.raises(ValueError, match="same items"):
        paired_loss(0.9, ar, filt[:-1])


def test_a_budget_walks_down_from_the_most_cautious_threshold_and_stops_at_the_first_it_cannot_vouch_for():
    z = 1.2815515655446004
    assert TABLE.threshold_for(100) == 0.4
    # 0.97 (upper 1.28) and 0.9 (upper 2.92) pass at 3 points; 0.6 fails, so 0.4's lucky estimate is never reached
    assert TABLE.threshold_for(3.0) == 0.9
    assert [(p.threshold, ok) for p, ok in TABLE.walk(3.0)] == [(0.97, True), (0.9, True), (0.6, False)]
    assert TABLE.threshold_for(z * 1.0) == 0.97
    assert TABLE.threshold_for(1.0) == 1.0  # not even the highest: the target for every token


def test_budgets_out_of_range_or_unresolvable_are_refused_with_what_is_accepted():
    for bad in (-1, 101, float("nan"), "2", True):
        with pytest.raises(ValueError, match=r"points of task quality in \[0, 100\]"):
            check_budget(bad)
    with pytest.raises(UncalibratedError, match="has no draft"):
        resolve_threshold(2, *table_for("smollm2-135m-instruct", None))
    with pytest.raises(InvalidRequestError, match="in \\[0, 100\\]"):  # a bad budget says so even without a table
        resolve_threshold(200, None, "none")
    assert resolve_threshold(3, TABLE, "test") == 0.9
    with pytest.raises(InvalidRequestError, match="not resolved"):
        DecodeParams(mode="filter", max_quality_loss=2).validate()
    with pytest.raises(InvalidRequestError, match="mode filter alone"):
        DecodeParams(mode="filter", threshold=0.9, min_agreement=0.9, max_quality_loss=2).validate()
    DecodeParams(mode="filter", threshold=0.9, max_quality_loss=2).validate()
    DecodeParams(mode="auto", threshold=1.0, max_quality_loss=2).validate()  # no threshold vouched for
    with pytest.raises(InvalidRequestError, match="mode filter alone, not 'auto'"):  # auto takes no threshold
        DecodeParams(mode="auto", threshold=0.9, max_quality_loss=2).validate()
    assert (budget_mode(0.97), budget_mode(1.0)) == ("filter", "auto")
    assert budget_decoding(3, TABLE, "test") == ("filter", 0.9)
    assert budget_decoding(0, TABLE, "test") == ("auto", 1.0)  # nothing vouched for: lossless
    assert budget_decoding(0, TABLE, "test", edge=True) == ("filter", 1.0)  # the edge client drafts


def test_a_pairs_table_comes_from_its_file_then_its_preset_and_an_unreadable_file_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("CALID_HOME", str(tmp_path))
    table, source = table_for("my-target", "my-draft")
    assert table is None and "calid bench pareto" in source
    path = quality_path("my-target", "my-draft")
    path.write_text(json.dumps(TABLE.to_json()))
    table, source = table_for("my-target", "my-draft")
    assert table == TABLE and source == str(path)
    given = tmp_path / "elsewhere.json"
    given.write_text(json.dumps(QualityTable((point(0.5, 0.0, 0.1),)).to_json()))
    assert table_for("my-target", "my-draft", str(given))[0].threshold_for(1) == 0.5
    with pytest.raises(ValueError, match="does not exist"):
        table_for("my-target", "my-draft", str(tmp_path / "missing.json"))
    path.write_text("{")
    with pytest.raises(ValueError, match="unreadable"):
        table_for("my-target", "my-draft")


def test_the_cli_resolves_the_budget_for_its_pair_and_refuses_conflicts(tmp_path, monkeypatch):
    from calid.cli_args import decode_params

    monkeypatch.setenv("CALID_HOME", str(tmp_path))
    quality_path("t", "d").write_text(json.dumps(TABLE.to_json()))

    def args(**kw):
        base = dict(mode="ar", gamma=8, threshold=None, rollback_nll=2.0, adaptive=False, tree_width=3,
                    tree_chains=1, min_agreement=None, max_quality_loss=None, model="t", draft="d")
        return argparse.Namespace(**(base | kw))

    d = decode_params(args(max_quality_loss=3.0))
    assert (d.mode, d.threshold, d.max_quality_loss) == ("filter", 0.9, 3.0)
    d = decode_params(args(max_quality_loss=0.1))  # no threshold vouched for: the target's tokens, by auto
    assert (d.mode, d.threshold, d.uses_draft) == ("auto", 1.0, False)
    with pytest.raises(CalidError, match="set one of"):
        decode_params(args(max_quality_loss=3.0, threshold=0.5))
    with pytest.raises(CalidError, match="for --mode filter"):
        decode_params(args(max_quality_loss=3.0, mode="speculative"))
    with pytest.raises(UncalibratedError, match="calid bench pareto"):
        decode_params(args(max_quality_loss=3.0, draft="other"))


def test_the_default_pair_ships_a_table_whose_walk_stops_where_its_measurements_say(tmp_path, monkeypatch):
    from calid.models.presets import DEFAULT_DRAFT, DEFAULT_TARGET

    monkeypatch.setenv("CALID_HOME", str(tmp_path))  # no calibration file: the preset
    table, source = table_for(DEFAULT_TARGET, DEFAULT_DRAFT)
    assert "preset" in source and table.task == "humaneval pass@1"
    assert [table.threshold_for(b) for b in (2, 5, 6, 10)] == [1.0, 1.0, 0.97, 0.9]
