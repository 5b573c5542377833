"""calid bench modes: what its rows say about whole requests, decoding alone and the prefill cap."""
from types import SimpleNamespace

import pytest

from serve_app.bench.modes import _round_order, _rows, _tpot_ms, _verdict, _waves


def _run(served_s, tpot_ms, first_tokens_s, outputs, drafted=0):
    return {"served_s": served_s, "tpot_ms": tpot_ms, "first_tokens_s": first_tokens_s, "tokens": 48,
            "outputs": outputs, "drafted": drafted, "guard_plain": 0, "serving_ms_per_step": 1.0}


def test_time_per_token_counts_from_the_first_token_and_skips_it():
    done = SimpleNamespace(stats={"ttft_ms": 1000.0, "total_ms": 3350.0}, token_ids=list(range(48)))
    assert _tpot_ms(done) == pytest.approx(50.0)  # 47 tokens after the first in 2.35 s
    one = SimpleNamespace(stats={"ttft_ms": 900.0, "total_ms": 900.0}, token_ids=[7])
    assert _tpot_ms(one) == 0.0


def test_rows_separate_decoding_from_whole_requests_and_bound_them_by_prefill():
    """A burst of 2 s of prefill and 2 s of decoding that decodes twice as fast gains 1.33x whole, 2x decoding;
    no mode could beat ar's 4 s by more than 4 / 2 = 2x on whole requests."""
    same, other = [[1, 2, 3]], [[1, 2, 4]]
    samples = {
        ("grounded", 1, "ar"): [_run(4.0, 40.0, 2.0, same), _run(4.2, 42.0, 2.1, same), _run(3.8, 38.0, 1.9, same)],
        ("grounded", 1, "auto"): [_run(3.0, 20.0, 2.0, same, drafted=30)] * 3,
        ("grounded", 1, "filter"): [_run(2.5, 15.0, 2.0, other, drafted=40)] * 3,
    }
    rows = {r["mode"]: r for r in _rows(samples, caps={1: {"cap": 3.0, "prefill_ratio": 0.4}})}
    ar, auto, lossy = rows["ar"], rows["auto"], rows["filter"]
    assert ar["served_vs_ar"] == 1.0 and ar["decode_vs_ar"] == 1.0
    assert auto["served_vs_ar"] == pytest.approx(4.0 / 3.0)
    assert auto["decode_vs_ar"] == pytest.approx(2.0)
    # each round against ar's run of the same round: 4.0 / 3.0, 4.2 / 3.0 and 3.8 / 3.0 seconds
    assert auto["rounds_vs_ar"] == "1.33 1.40 1.27" and ar["rounds_vs_ar"] == "1.00 1.00 1.00"
    assert auto["prefill_cap"] == pytest.approx(2.0) and ar["prefill_cap"] == pytest.approx(2.0)
    assert auto["same_as_ar"] == "1/1" and lossy["same_as_ar"] == "0/1"
    assert auto["draft_share"] == pytest.approx(30 / 48)
    assert not any(k.startswith("_") for r in rows.values() for k in r)  # working values stay out of the report
    verdict = _verdict(list(rows.values()), ["ar", "auto", "filter"])
    assert "grounded c1 auto: 1.33x ar served (target >= 1.3: met; by round 1.33 1.40 1.27); " \
           "decoding alone 2.00x ar; whole requests cannot beat ar by more than 2.00x here (prefill)" in verdict
    replayed = _verdict(list(rows.values()), ["ar", "auto", "filter"],
                        replays={("grounded", 1): SimpleNamespace(ratio=1.8)})
    assert "prefill); the planner's copies replayed on ar's outputs 1.80x (decoding alone, no noise)" in replayed
    known = _verdict(
        list(rows.values()),
        ["ar", "auto", "filter"],
        replays={("grounded", 1): SimpleNamespace(ratio=1.8)},
        foresights={("grounded", 1): SimpleNamespace(ratio=3.0)},
    )
    # filter: decoding at most 3x as fast; half of ar's time prefilling, and 0.4 of that again on the draft
    assert lossy["filter_cap"] == 3.0 and lossy["filter_cap_whole"] == pytest.approx(1 / (0.5 * 1.4 + 0.5 / 3))
    assert auto["filter_cap"] == "-" and auto["filter_cap_whole"] == "-"
    assert "grounded c1 filter: 1.60x ar served" in verdict and \
        "cap on this machine 3.00x (decoding alone), 1.15x on whole requests (the draft prefills" in verdict
    # prefill is half of ar's time (cap 2.0): decoding 3x faster leaves 0.5 + 0.5 / 3 of it
    assert "(decoding alone, no noise); with each copy's yield known 3.00x, 1.50x on whole requests" in known


def test_a_decoding_speed_up_counts_on_whole_requests_only_past_the_prefill():
    from serve_app.bench.modes import _whole

    # prefill is 60% of ar's time (cap 1/0.6): a 1.52x decoding bound is 1.16x on whole requests
    assert _whole(1.52, 1 / 0.6) == pytest.approx(1 / (0.6 + 0.4 / 1.52))
    assert _whole(1.0, 2.0) == pytest.approx(1.0) and _whole(1e9, 2.0) == pytest.approx(2.0)


def test_answers_that_stop_at_eos_are_rated_by_their_own_tokens():
    """Answers run to their end (EOS, the default): a mode's runs may stop at different lengths, so each run
    is rated by its own tokens and seconds (median over runs), served and in process."""
    runs = [dict(_run(4.0, 40.0, 2.0, [[1]]), tokens=100, inproc_s=2.0, inproc_tokens=100),
            dict(_run(3.0, 40.0, 2.0, [[1]]), tokens=90, inproc_s=3.0, inproc_tokens=90),
            dict(_run(2.0, 40.0, 2.0, [[1]]), tokens=80, inproc_s=1.0, inproc_tokens=80)]
    row = _rows({("grounded", 1, "ar"): runs}, caps={})[0]
    assert row["served_tok_s"] == pytest.approx(30.0)  # 25, 30 and 40 tokens/s
    assert row["inproc_tok_s"] == pytest.approx(50.0)  # 50, 30 and 80


def test_modes_run_in_reverse_order_every_other_round():
    """A machine that slows (or speeds up) through a run must not always charge its drift to the modes after ar."""
    modes = ["ar", "auto", "filter"]
    assert _round_order(modes, 0) == modes and _round_order(modes, 2) == modes
    assert _round_order(modes, 1) == ["filter", "auto", "ar"]
    assert modes == ["ar", "auto", "filter"]  # the caller's list is left as it was


def test_every_point_runs_the_same_prompts_in_waves_of_its_concurrency():
    prompts = [f"p{i}" for i in range(8)]
    assert _waves(prompts, 1) == [[p] for p in prompts]  # one client: eight requests one after another
    assert _waves(prompts, 3) == [prompts[:3], prompts[3:6], prompts[6:]]  # the last wave holds what is left
    assert _waves(prompts, 8) == [prompts] and _waves(prompts, 16) == [prompts]
    assert [p for wave in _waves(prompts, 4) for p in wave] == prompts
