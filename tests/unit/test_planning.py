"""The step planner with hand-built cost models: when drafting pays and when it does not."""
import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calid.planning import (AR, Acceptance, Choice, CostTable, PlanInput, batch_level, expected_tokens, guard_bucket,
                            plan_group, plan_steps, NO_END, _Problem, _Step, _search, split_cost, step_rate,
                            step_saving)


def table(points: dict[int, float]) -> CostTable:
    t = CostTable()
    for size, secs in points.items():
        t.observe(size, secs)
    return t


GPU_LIKE = table({1: 0.020, 9: 0.022, 32: 0.030, 128: 0.060})  # verifying is almost free: memory-bound
CPU_LIKE = table({1: 0.036, 2: 0.060, 4: 0.095, 8: 0.173, 16: 0.219})  # llama.cpp, 2 cores: compute-bound
CHEAP_DRAFT = table({1: 0.002, 16: 0.004})


def copy(n: int, alpha: float) -> dict:
    """An n-gram proposal of ``n`` tokens each of which holds with chance ``alpha`` (given the ones before)."""
    return {"ngram": n, "ngram_survival": tuple(alpha ** j for j in range(1, n + 1))}


def spec(g: int) -> Choice:
    return Choice("speculative", g)


def depths(plan: list[Choice]) -> list[int]:
    return [c.gamma if c.mode == "speculative" else 0 for c in plan]


def test_idle_target_and_high_acceptance_drafts_long():
    assert plan_steps([PlanInput(alpha=0.9, cap=8)], GPU_LIKE, CHEAP_DRAFT) == [spec(8)]


def test_low_acceptance_drafts_short_or_nothing():
    c = plan_steps([PlanInput(alpha=0.2, cap=8)], GPU_LIKE, CHEAP_DRAFT)[0]
    assert c.mode in ("ar", "speculative") and c.gamma <= 1


def test_a_compute_bound_target_drafts_nothing():
    """Where verification costs about as much per token as a decode step, speculation cannot pay."""
    draft = table({1: 0.017, 8: 0.08})
    assert plan_steps([PlanInput(alpha=0.9, cap=8)], CPU_LIKE, draft) == [AR]


def test_a_saturated_target_drafts_nothing_while_an_idle_one_drafts():
    saturated = table({1: 0.02, 16: 0.03, 32: 0.06, 64: 0.12, 200: 0.40})  # linear beyond 32 tokens
    reqs = [PlanInput(alpha=0.7, cap=6)] * 64
    assert plan_steps(reqs, saturated, CHEAP_DRAFT) == [AR] * 64
    assert plan_steps(reqs[:2], saturated, CHEAP_DRAFT) != [AR, AR]


def test_caps_are_respected_and_unknown_costs_mean_no_drafting():
    assert plan_steps([PlanInput(alpha=0.99, cap=3)], GPU_LIKE, CHEAP_DRAFT) == [spec(3)]
    assert plan_steps([PlanInput(alpha=0.99, cap=3)], CostTable(), CHEAP_DRAFT) == [AR]


def test_the_plan_is_no_worse_than_plain_decoding():
    reqs = [PlanInput(alpha=a, cap=8) for a in (0.1, 0.5, 0.8, 0.95)]
    for verify in (GPU_LIKE, CPU_LIKE):
        plan = plan_steps(reqs, verify, CHEAP_DRAFT)
        assert step_rate(plan, reqs, verify, CHEAP_DRAFT) >= step_rate([AR] * 4, reqs, verify, CHEAP_DRAFT)


def test_cost_table_interpolates_and_smooths():
    t = table({1: 1.0, 5: 3.0})
    assert t(3) == pytest.approx(2.0) and t(10) == pytest.approx(6.0)
    t.observe(5, 4.0)
    assert t(5) == pytest.approx(3.3)  # a new timing moves the estimate by SMOOTHING


def test_expected_tokens_and_acceptance_estimate():
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    a = Acceptance()
    assert a.alpha == 0.5
    for _ in range(20):
        a.observe(accepted=4, proposed=4)
    assert a.alpha > 0.9
    for _ in range(20):
        a.observe(accepted=0, proposed=4)
    assert a.alpha < 0.5


def test_lookahead_is_picked_where_verifying_is_nearly_free_and_its_trie_pays():
    lookahead = Choice("lookahead", 8)
    la = PlanInput(alpha=0.5, cap=8, lookahead_gain=3.0)
    assert plan_steps([la], GPU_LIKE, CostTable()) == [lookahead]  # no draft model: lookahead or ar
    assert plan_steps([la], CPU_LIKE, CostTable()) == [AR]  # 9 tokens cost ~5 decodes: 4 tokens do not pay
    assert plan_steps([PlanInput(alpha=0.5, cap=8)], GPU_LIKE, CostTable()) == [AR]  # not an option: ar
    assert plan_steps([PlanInput(alpha=0.5, cap=0, lookahead_gain=3.0)], GPU_LIKE, CostTable()) == [AR]  # no room
    # a good draft beats a poor trie, a rich trie beats a poor draft
    assert plan_steps([PlanInput(alpha=0.9, cap=8, lookahead_gain=0.2)], GPU_LIKE, CHEAP_DRAFT) == [spec(8)]
    assert plan_steps([PlanInput(alpha=0.1, cap=8, lookahead_gain=6.0)], GPU_LIKE, CHEAP_DRAFT) == [lookahead]


def test_lookahead_gain_follows_what_the_steps_yield():
    from calid.planning import Gain

    g = Gain()
    assert g.mean == 0.5  # the prior: worth a try where verification is cheap
    for _ in range(30):
        g.observe(0)
    assert g.mean < 0.01
    for _ in range(30):
        g.observe(5)
    assert g.mean == pytest.approx(5, abs=0.01)


def test_a_tree_is_picked_where_it_beats_the_chain_and_its_extra_tokens_verify_cheaply():
    better_tree = PlanInput(alpha=0.5, cap=8, tree_alpha=0.8)
    plan = plan_steps([better_tree], GPU_LIKE, CHEAP_DRAFT)
    assert plan[0].mode == "tree" and plan[0].gamma >= 4
    no_better = PlanInput(alpha=0.8, cap=8, tree_alpha=0.8)  # same acceptance, more tokens to verify
    assert plan_steps([no_better], GPU_LIKE, CHEAP_DRAFT)[0].mode == "speculative"
    assert plan_steps([better_tree], CPU_LIKE, table({1: 0.017, 8: 0.08})) == [AR]
    assert plan_steps([better_tree], GPU_LIKE, CostTable()) == [AR]  # no draft model: no tree either


def test_a_batch_drafts_together_where_no_single_request_would_alone():
    """A batched draft step costs about as much for one request as for sixteen: drafting pays for the batch
    only when all draft, which a search that moves one request at a time from plain decoding never finds."""
    verify = table({1: 0.020, 16: 0.0235, 32: 0.027, 64: 0.034, 160: 0.060})
    reqs = [PlanInput(alpha=0.7, cap=8)] * 16
    plan = plan_steps(reqs, verify, CHEAP_DRAFT)
    assert all(c.mode == "speculative" for c in plan)
    assert step_rate(plan, reqs, verify, CHEAP_DRAFT) > 1.1 * step_rate([AR] * 16, reqs, verify, CHEAP_DRAFT)



# ---- n-gram drafts (copies of the request's own tokens): verification only, no draft time ---------------

def test_an_ngram_chain_is_taken_where_it_pays_and_only_as_long_as_the_match():
    grounded = PlanInput(alpha=0.5, cap=8, **copy(5, 0.95))
    assert plan_steps([grounded], GPU_LIKE, CHEAP_DRAFT) == [Choice("ngram", 5)]
    assert plan_steps([grounded], GPU_LIKE, CostTable()) == [Choice("ngram", 5)]  # no draft model needed


def test_an_ngram_chain_may_run_past_the_draft_length():
    """The request's cap (gamma) bounds draft-model chains; an n-gram proposal comes capped by its own limit."""
    long = PlanInput(alpha=0.5, cap=8, **copy(20, 0.97))
    assert Choice("ngram", 20) in long.options(True)
    assert plan_steps([long], GPU_LIKE, CostTable()) == [Choice("ngram", 20)]


QWEN_15B = table({1: 0.034, 2: 0.057, 4: 0.093, 8: 0.216, 16: 0.272, 32: 0.429})  # llama.cpp, calibrated


def test_a_sliced_batch_costs_a_shared_slice_then_one_slice_per_longer_sequence():
    """llama.cpp with a KV stream per sequence runs 1 x 17 + 11 x 1 tokens as 12 x 1, then 1 x 16."""
    assert split_cost([17] + [1] * 11, QWEN_15B) == pytest.approx(QWEN_15B(12) + QWEN_15B(16))
    assert split_cost([3, 3, 1], QWEN_15B) == pytest.approx(QWEN_15B(3) + 2 * QWEN_15B(2))
    assert split_cost([4, 4], QWEN_15B) == pytest.approx(QWEN_15B(8))
    assert split_cost([5], QWEN_15B) == pytest.approx(QWEN_15B(5))
    assert split_cost([], QWEN_15B) == 0.0


# Qwen 1.5B Q4_K_M, llama.cpp, 2-core Xeon, huge pages: one sequence of n tokens (calid.calibration)
QWEN_15B_XEON = table({1: 0.068, 2: 0.107, 3: 0.124, 4: 0.115, 5: 0.148, 6: 0.168, 7: 0.191, 8: 0.203, 9: 0.218,
                       12: 0.260, 15: 0.300, 16: 0.251, 20: 0.343, 24: 0.408, 32: 0.454})


def test_a_mixed_batch_is_padded_to_the_level_that_prices_it_lowest():
    """Chains of 5, 5, 1 and 3 tokens run as 4 x 1, 3 x 2, 2 x 2 unpadded (3 slices, measured 405 ms on that
    machine) and as one slice of 4 x 5 padded to 5 (298 ms): padding wins. One 17-token chain beside 11 plain
    steps is not padded (12 x 17 tokens would cost far more than a second slice)."""
    assert batch_level([5, 5, 1, 3], QWEN_15B_XEON) == 5
    assert split_cost([5, 5, 1, 3], QWEN_15B_XEON) == pytest.approx(QWEN_15B_XEON(20))
    assert batch_level([17] + [1] * 11, QWEN_15B_XEON) == 1
    assert split_cost([17] + [1] * 11, QWEN_15B_XEON) == pytest.approx(QWEN_15B_XEON(12) + QWEN_15B_XEON(16))
    assert batch_level([3, 3, 3], QWEN_15B_XEON) == 3 and batch_level([], QWEN_15B_XEON) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 33), min_size=1, max_size=16))
def test_the_level_is_the_cheapest_of_the_sequences_own_lengths(lengths):
    def levelled(level):
        return QWEN_15B_XEON(level * len(lengths)) + sum(QWEN_15B_XEON(x - level) for x in lengths if x > level)

    cost = split_cost(lengths, QWEN_15B_XEON)
    assert cost == pytest.approx(min(levelled(x) for x in set(lengths)))
    assert cost <= levelled(min(lengths)) + 1e-12  # never dearer than not padding
    assert batch_level(lengths, QWEN_15B_XEON) in lengths


def test_the_planner_prices_every_choice_by_slices_as_split_cost_does():
    """The planner's incremental pricing (one request's options beside the others' choices) agrees with
    split_cost over the whole batch, for random batches of n-gram chains, and its plan is no worse than ar."""
    rng = random.Random(7)
    for _ in range(200):
        reqs = [PlanInput(alpha=0.5, cap=0, **copy(rng.randint(0, 20), 0.9)) for _ in range(rng.randint(1, 12))]
        plan = [Choice("ngram", rng.randint(1, r.ngram)) if r.ngram else AR for r in reqs]
        fixed = rng.randint(0, 3)
        lengths = [r.verified(c) for r, c in zip(reqs, plan)] + [1] * fixed
        want = split_cost(lengths, QWEN_15B)
        assert step_saving(plan, reqs, QWEN_15B, CostTable(), fixed, sliced=True)[1] == pytest.approx(want)
        best = plan_steps(reqs, QWEN_15B, CostTable(), fixed, sliced=True)
        got = step_rate(best, reqs, QWEN_15B, CostTable(), fixed, sliced=True)
        assert got >= step_rate([AR] * len(reqs), reqs, QWEN_15B, CostTable(), fixed, sliced=True)
    lone = [PlanInput(alpha=0.5, cap=0, **copy(6, 0.9))] + [PlanInput(alpha=0.5, cap=0, **copy(4, 0.9))] * 3
    for c in (Choice("ngram", g) for g in range(1, 7)):  # the first request shorter than every other one
        plan = [c] + [Choice("ngram", 4)] * 3
        want = split_cost([1 + c.gamma] + [5] * 3, QWEN_15B)
        assert step_saving(plan, lone, QWEN_15B, CostTable(), sliced=True)[1] == pytest.approx(want)


def test_one_long_copy_beside_plain_requests_pays_only_where_it_saves_whole_steps():
    """12 requests, one with a copy that has held for long (about 14 tokens expected). Beside 11 requests as far
    along as it, its tokens save only its row of later plain steps (about 7 ms a token here): not worth a 28-token
    forward (0.39 s), still less 12 tokens then 16 as llama.cpp slices it (0.52 s). Where it is the request furthest
    behind, they save steps it would decode alone (34 ms a token): the copy pays, even sliced. Alone, the copy is one
    slice and pays either way."""
    even = [PlanInput(alpha=0.5, cap=0, remaining=40, **copy(16, 0.97))] + [
        PlanInput(alpha=0.5, cap=0, remaining=40)
    ] * 11
    assert plan_steps(even, QWEN_15B, CostTable()) == [AR] * 12
    assert plan_steps(even, QWEN_15B, CostTable(), sliced=True) == [AR] * 12
    behind = [PlanInput(alpha=0.5, cap=0, remaining=48, **copy(16, 0.97))] + [
        PlanInput(alpha=0.5, cap=0, remaining=8)
    ] * 11
    assert plan_steps(behind, QWEN_15B, CostTable())[0].mode == "ngram"
    assert plan_steps(behind, QWEN_15B, CostTable(), sliced=True)[0].mode == "ngram"
    assert plan_steps(even[:1], QWEN_15B, CostTable(), sliced=True) == plan_steps(even[:1], QWEN_15B, CostTable())
    assert plan_steps(even[:1], QWEN_15B, CostTable(), sliced=True)[0].mode == "ngram"


def _outcomes_of(left: float, r: PlanInput, c: Choice) -> list[tuple[float, float]]:
    """Tokens left after the step with their chances, enumerated from the survival (an end known) or at the mean."""
    if r.remaining is None or c.mode != "ngram":
        return [(max(0.0, left - r.tokens(c)), 1.0)]
    s = [1.0, *r.survival(c), 0.0]
    return [(max(0.0, left - 1 - j), s[j] - s[j + 1]) for j in range(c.gamma + 1)]


def test_the_planner_values_each_choice_by_the_expected_cost_to_go_of_the_whole_batch():
    """The planner's value of a step (plain decoding time saved per second) agrees with the cost to go averaged over
    every joint outcome of the batch's copies (each holds for j tokens with chance S(j) - S(j+1), independently), for
    random batches with known and unknown ends; each request's incremental value agrees with it; the plan is no worse
    than ar."""
    rng = random.Random(11)
    for _ in range(200):
        n = rng.randint(1, 4)
        reqs = [PlanInput(alpha=0.5, cap=0, remaining=rng.choice([None, rng.randint(1, 40)]),
                          **copy(rng.randint(0, 5), rng.uniform(0.3, 1.0))) for _ in range(n)]
        plan = [Choice("ngram", rng.randint(1, r.ngram)) if r.ngram else AR for r in reqs]
        fixed = rng.randint(0, 3)
        rows = [CPU_LIKE(fixed + k) for k in range(n + 1)]
        rows = [max(rows[: k + 1]) for k in range(n + 1)]
        weights = [b - a for a, b in zip(rows, rows[1:])]

        def togo(left):
            return sum(x * w for x, w in zip(sorted(left, reverse=True), weights))
        known = [r.remaining for r in reqs if r.remaining is not None]
        start = [max(known, default=0) + NO_END if r.remaining is None else r.remaining for r in reqs]  # behind all
        each = [_outcomes_of(x, r, c) if n > 1 else [(max(0.0, x - r.tokens(c)), 1.0)]
                for x, r, c in zip(start, reqs, plan)]
        after = sum(math.prod(p for _, p in joint) * togo([x for x, _ in joint]) for joint in itertools.product(*each))
        seconds = step_saving(plan, reqs, CPU_LIKE, CostTable(), fixed)[1]
        want = (togo(start) - after) / seconds
        assert step_rate(plan, reqs, CPU_LIKE, CostTable(), fixed) == pytest.approx(want, rel=1e-6, abs=1e-9)
        step = _Step(reqs, CPU_LIKE, CostTable(), fixed, plan)
        for i, r in enumerate(reqs):  # each request's best option, priced incrementally, as the whole step prices it
            assert step.choose(i, r.options(False)) == pytest.approx(step.rate(), rel=1e-9, abs=1e-12)
        best = plan_steps(reqs, CPU_LIKE, CostTable(), fixed)
        assert step_rate(best, reqs, CPU_LIKE, CostTable(), fixed) >= step_rate([AR] * n, reqs, CPU_LIKE, CostTable(),
                                                                                 fixed) * (1 - 1e-12)


def test_larger_batches_price_each_choice_as_the_whole_step_does():
    """Up to 12 requests with copies up to 32 tokens deep (merged into a few outcomes each): one request's options
    priced beside the others' agree with the whole step's price, and the plan is no worse than ar."""
    rng = random.Random(5)
    for _ in range(60):
        n = rng.randint(2, 12)
        reqs = [PlanInput(alpha=0.5, cap=0, remaining=rng.choice([None, rng.randint(1, 60)]),
                          ngram=(g := rng.randint(0, 32)), ngram_survival=survival(rng.randint(1, 30), g))
                for _ in range(n)]
        plan = [Choice("ngram", rng.randint(1, r.ngram)) if r.ngram else AR for r in reqs]
        step = _Step(reqs, QWEN_15B, CostTable(), 1, plan)
        for i, r in enumerate(reqs):
            assert step.choose(i, r.options(False)) == pytest.approx(step.rate(), rel=1e-9, abs=1e-12)
        best = plan_steps(reqs, QWEN_15B, CostTable(), 1)
        assert step_rate(best, reqs, QWEN_15B, CostTable(), 1) >= step_rate([AR] * n, reqs, QWEN_15B, CostTable(), 1)


def survival(agreed: int, g: int) -> tuple[float, ...]:
    """A copy's survival as calid.decoding.ngram.Copy gives it after ``agreed`` tokens of agreement: a / (a + j)."""
    return tuple(agreed / (agreed + j) for j in range(1, g + 1))


def test_a_burst_drafts_less_where_some_copies_will_hold_and_others_break():
    """4 requests 48 tokens from the end, each with a fresh copy (it has agreed for 2 tokens: S(j) = 2 / (2 + j)). At
    their means, 3-token copies pay; but what a burst saves is set by the request that ends up furthest behind, and
    with four such copies one of them likely breaks at once: priced over what they may yield, they do not pay.
    Copies that hold (agreed for 300 tokens) pay either way, and one request alone, or requests with no known end,
    are priced as before (tokens per second)."""
    fresh = [PlanInput(alpha=0.5, cap=0, remaining=48, ngram=8, ngram_survival=survival(2, 8)) for _ in range(4)]
    at_means = _search(_Problem(fresh, CPU_LIKE, CostTable()), 2, spread=False)
    assert all(c.mode == "ngram" for c in at_means)
    plain = step_rate([AR] * 4, fresh, CPU_LIKE, CostTable())
    assert step_rate(at_means, fresh, CPU_LIKE, CostTable(), spread=False) > plain > step_rate(at_means, fresh,
                                                                                              CPU_LIKE, CostTable())
    assert plan_steps(fresh, CPU_LIKE, CostTable()) == [AR] * 4
    held = [PlanInput(alpha=0.5, cap=0, remaining=48, ngram=16, ngram_survival=survival(300, 16)) for _ in range(4)]
    assert all(c.mode == "ngram" for c in plan_steps(held, CPU_LIKE, CostTable()))
    alone = fresh[:1]
    for c in (Choice("ngram", g) for g in (1, 4, 16)):
        assert step_rate([c], alone, CPU_LIKE, CostTable()) == pytest.approx(
            step_rate([c], alone, CPU_LIKE, CostTable(), spread=False))
    unknown = [PlanInput(alpha=0.5, cap=0, ngram=16, ngram_survival=survival(3, 16)) for _ in range(4)]  # no end
    assert step_rate([Choice("ngram", 16)] * 4, unknown, CPU_LIKE, CostTable()) == pytest.approx(
        step_rate([Choice("ngram", 16)] * 4, unknown, CPU_LIKE, CostTable(), spread=False))


def test_deep_chains_are_merged_into_a_few_outcomes_with_the_same_chance_and_mean():
    from calid.planning import SPREAD_ATOMS, _outcomes

    for agreed, g, left in ((1, 32, 48.0), (30, 32, 48.0), (3, 16, 10.0), (2, 5, 48.0)):
        s = survival(agreed, g)
        full = [(max(0.0, left - 1 - j), a - b) for j, (a, b) in enumerate(zip((1.0, *s), (*s, 0.0)))]
        got = _outcomes(left, s)
        assert len(got) == min(len(full), SPREAD_ATOMS)
        assert sum(p for _, p in got) == pytest.approx(1.0)
        assert sum(x * p for x, p in got) == pytest.approx(sum(x * p for x, p in full))
        assert got[0] == full[0] and got[-1] == full[-1]  # breaks at once; holds whole: kept apart


def test_tokens_are_worth_the_plain_steps_they_save_in_a_batch_that_shrinks_as_requests_finish():
    """4 requests as far along as each other on a compute-bound CPU: copies for all of them pay, the same copy for one
    of them does not (it would finish early and leave the others decoding in smaller, dearer-per-token steps), and
    for the one furthest behind it does. At one request the value is its tokens per second x a plain step."""
    good = copy(6, 0.9)
    together = [PlanInput(alpha=0.5, cap=0, remaining=40, **good) for _ in range(4)]
    assert all(c.mode == "ngram" for c in plan_steps(together, CPU_LIKE, CostTable()))
    one = [PlanInput(alpha=0.5, cap=0, remaining=40, **good)] + [PlanInput(alpha=0.5, cap=0, remaining=40)] * 3
    assert plan_steps(one, CPU_LIKE, CostTable()) == [AR] * 4
    last = [PlanInput(alpha=0.5, cap=0, remaining=40, **good)] + [PlanInput(alpha=0.5, cap=0, remaining=20)] * 3
    assert plan_steps(last, CPU_LIKE, CostTable())[0].mode == "ngram"
    alone, plan = together[:1], [Choice("ngram", 6)]
    assert step_rate(plan, alone, CPU_LIKE, CostTable()) == pytest.approx(
        alone[0].tokens(plan[0]) / step_saving(plan, alone, CPU_LIKE, CostTable())[1] * CPU_LIKE(1))


def test_where_the_batch_is_sliced_only_forwards_of_one_slice_are_timed():
    from calid.orchestrator import Orchestrator

    orch = Orchestrator(None, frozenset(), max_position=512, has_draft=False)
    orch.sliced = True
    orch.observe_verify(28, 0.679, "r0", lengths=[17] + [1] * 11)  # two slices: not a 28-token forward's cost
    orch.observe_verify(40, 0.500, "r0")  # lengths not known
    assert orch.verify_cost.as_dict() == {}
    orch.observe_verify(12, 0.322, "r0", lengths=[1] * 12)
    orch.observe_verify(16, 0.320, lengths=[16])
    assert orch.verify_cost.as_dict() == {12: 0.322, 16: 0.320}
    orch.sliced = False
    orch.observe_verify(28, 0.679, "r0", lengths=[17] + [1] * 11)
    assert orch.verify_cost.as_dict()[28] == 0.679


def test_an_ngram_chain_is_worth_what_its_survival_says_position_by_position():
    """A copy that holds for 12 tokens and then breaks: worth 13 tokens at 12, nothing more past it, so on a
    compute-bound CPU (cost(13) ~ 5.5 steps) the planner verifies exactly 12."""
    holds = PlanInput(alpha=0.5, cap=8, ngram=20, ngram_survival=(0.97,) * 12 + (0.0,) * 8)
    assert holds.tokens(Choice("ngram", 12)) == pytest.approx(1 + 12 * 0.97)
    assert holds.tokens(Choice("ngram", 20)) == holds.tokens(Choice("ngram", 12))
    assert plan_steps([holds], CPU_LIKE, CostTable()) == [Choice("ngram", 12)]


def test_no_match_or_a_poor_record_means_no_ngram_chain():
    assert all(c.mode != "ngram" for c in PlanInput(alpha=0.5, cap=8, ngram=0).options(True))
    assert plan_steps([PlanInput(alpha=0.1, cap=8, **copy(6, 0.1))], CPU_LIKE, CostTable()) == [AR]


def test_on_a_compute_bound_cpu_an_ngram_chain_needs_a_high_acceptance():
    """Verifying 5 tokens costs ~3 steps on CPU_LIKE: a chain copied from the input pays only when it is
    nearly always right; a draft model's chain of the same acceptance never pays (its draft time too)."""
    draft = table({1: 0.017, 8: 0.08})
    assert plan_steps([PlanInput(alpha=0.97, cap=8, **copy(8, 0.97))], CPU_LIKE, draft)[0].mode == "ngram"
    assert plan_steps([PlanInput(alpha=0.97, cap=8)], CPU_LIKE, draft) == [AR]
    assert plan_steps([PlanInput(alpha=0.5, cap=8, **copy(8, 0.5))], CPU_LIKE, draft) == [AR]


def test_a_draft_that_must_catch_up_first_pays_for_it_in_the_step():
    """A request the draft has not seen costs its catch-up too: a chain that pays on a warm draft does not
    pay when the draft must first prefill 300 tokens."""
    warm = PlanInput(alpha=0.9, cap=8)
    cold = PlanInput(alpha=0.9, cap=8, draft_setup_s=300 * 0.002)
    assert plan_steps([warm], GPU_LIKE, CHEAP_DRAFT)[0].mode == "speculative"
    assert plan_steps([cold], GPU_LIKE, CHEAP_DRAFT) == [AR]
    assert plan_steps([PlanInput(alpha=0.9, cap=8, **copy(4, 0.9), draft_setup_s=1.0)], GPU_LIKE,
                      CHEAP_DRAFT) == [Choice("ngram", 4)]  # an n-gram chain needs no draft model


# ---- StepGuard: the plan checked against measured steps ------------------------------------------------

def _guard_after(plain_ms: float, drafted_ms: float, requests: int = 4, depth: int = 2,
                 forecast_ms: float | None = None, yielded: float = 1.0):
    """A guard that has seen GUARD_MIN plain steps (forecast exactly: one token per request at ``plain_ms`` per
    token) and GUARD_MIN drafting steps ``depth`` deep, forecast at two tokens per request at ``forecast_ms`` per
    token (default: ``drafted_ms``), that took ``drafted_ms`` per forecast token and yielded ``yielded`` of the
    forecast extra tokens. Every token saves the same (one unit of plain decoding), as where requests draft alike."""
    from calid.planning import GUARD_MIN, Forecast, StepGuard

    g = StepGuard()
    plain_s, forecast_s = plain_ms * requests / 1000, (forecast_ms or drafted_ms) * 2 * requests / 1000
    for _ in range(GUARD_MIN):
        g.observe(requests, 0, plain_s, requests, requests, Forecast.plain(requests, plain_s))
        made = round(requests * (1 + yielded))
        g.observe(requests, depth, drafted_ms * 2 * requests / 1000, made, made,
                  Forecast(2 * requests, forecast_s, requests, plain_s))
    return g


def _forecast(ms_per_token: float, plain_ms: float = 26.0, requests: int = 4):
    """A drafting step forecast at two tokens per request at ``ms_per_token``, beside plain steps at ``plain_ms``."""
    from calid.planning import Forecast

    return Forecast(2 * requests, ms_per_token * 2 * requests / 1000, requests, plain_ms * requests / 1000)


def test_the_guard_runs_steps_plain_where_drafting_forecasts_do_not_hold_and_still_explores():
    from calid.planning import GUARD_EXPLORE

    g = _guard_after(plain_ms=26.0, drafted_ms=30.0, forecast_ms=20.0)  # forecast 20 ms a token, took 30
    verdicts = [g.allow(4, 2, _forecast(20.0)) for _ in range(2 * GUARD_EXPLORE)]
    assert verdicts.count(True) == 2 and g.overruled == 2 * GUARD_EXPLORE - 2
    assert g.summary() == {"drafted<4@4": 30.0, "plain@4": 26.0}
    assert g.allow(4, 2, _forecast(15.0))  # 1.5 x 15 = 22.5 ms: drafting wins even as its forecasts go


def test_copies_that_break_sooner_than_forecast_shrink_what_a_forecast_promises():
    g = _guard_after(plain_ms=26.0, drafted_ms=15.0, yielded=0.5)  # half the forecast extra tokens came
    assert not g.allow(4, 2, _forecast(20.0))  # 160 ms for 4 + 4 x 0.5 = 6 tokens: 26.7 ms each, plain 26
    assert g.allow(4, 2, _forecast(15.0))  # 120 ms for 6 tokens: 20 ms each


def test_the_guard_follows_the_planner_where_forecasts_hold_with_a_plain_step_now_and_then():
    from calid.planning import GUARD_EXPLORE

    g = _guard_after(plain_ms=26.0, drafted_ms=15.0)
    verdicts = [g.allow(4, 2, _forecast(15.0)) for _ in range(2 * GUARD_EXPLORE)]
    assert verdicts.count(False) == 2
    clear_win = _guard_after(plain_ms=26.0, drafted_ms=23.0)  # 11.5% cheaper: past the margin
    assert sum(clear_win.allow(4, 2, _forecast(23.0)) for _ in range(GUARD_EXPLORE)) == GUARD_EXPLORE - 1


def test_a_tie_or_a_win_inside_the_margin_runs_plain():
    """Drafting that measures about as fast as plain steps (closed-loop n-gram chains at 8 requests: 37.3 against
    36.7 ms per token; the mix workload in a closed loop at 4 requests: 0.92-1.03x ar at a 3% margin, 1.04-1.06x at
    10%) costs the target more tokens than it saves: the server's own choice must not lose, so drafting runs only
    where it is measurably faster."""
    from calid.planning import GUARD_EXPLORE

    for drafted_ms in (26.4, 26.0, 25.6, 24.0):  # 1.5% dearer, equal, 1.5% and 8% cheaper: inside the 10% margin
        g = _guard_after(plain_ms=26.0, drafted_ms=drafted_ms)
        assert sum(g.allow(4, 2, _forecast(drafted_ms)) for _ in range(GUARD_EXPLORE)) == 1  # only the exploring step


def test_a_strong_forecast_drafts_where_weak_ones_of_its_depth_did_not_pay():
    """Grounded workload at one request (Qwen 1.5B, in process): long copies of a refactor and a summary's short
    ones share a depth; those steps measured 33.8 ms per token against 34.1 plain, and the guard that judged
    them by that ran 25 of 28 planned steps of a refactor plain, where the oracle bound is 1.79x. Their forecasts
    held: a copy forecast at 27 ms per token drafts, one forecast at a plain step's cost does not."""
    g = _guard_after(plain_ms=34.0, drafted_ms=33.8, requests=1, depth=3)
    assert g.summary() == {"drafted4+@1": 33.8, "plain@1": 34.0}
    assert g.allow(1, 3, _forecast(27.0, plain_ms=34.0, requests=1))
    assert not g.allow(1, 3, _forecast(33.8, plain_ms=34.0, requests=1))


def test_short_bets_and_long_copies_are_corrected_apart():
    """A summary's one shaky copied token and a refactor's 16-token copy that has agreed for a while are different
    bets: the short ones' misses must not shrink what the long ones promise."""
    from calid.planning import GUARD_MIN, Forecast, draft_depth

    assert [draft_depth(x) for x in (0.2, 0.99, 1.0, 3.9, 4.0, 20.0)] == [1, 1, 2, 2, 3, 3]
    g = _guard_after(plain_ms=26.0, drafted_ms=20.0, depth=1, yielded=0.0)  # short drafts: nothing accepted
    for _ in range(GUARD_MIN):  # long copies: 8 tokens a request at 13 ms per token, as forecast
        g.observe(4, 3, 13.0 * 8 * 4 / 1000, 8 * 4, 8 * 4, Forecast(8 * 4, 13.0 * 8 * 4 / 1000, 4, 0.104))
    assert not g.allow(4, 1, _forecast(20.0)) and g.allow(4, 3, _forecast(20.0))
    assert g.summary() == {"plain@4": 26.0, "drafted<1@4": 40.0, "drafted4+@4": 13.0}


def test_a_depth_with_too_few_steps_is_judged_by_every_drafting_step_of_its_size():
    g = _guard_after(plain_ms=26.0, drafted_ms=40.0, depth=1, forecast_ms=20.0)  # depth 1 took twice its forecast
    assert not g.allow(4, 2, _forecast(20.0))  # depth 2 unmeasured: 2 x 20 = 40 ms a token
    assert g.allow(4, 2, _forecast(10.0))  # 20 ms a token


def _auto_requests(verify: dict[int, float], draft: dict[int, float], rids: str, max_new_tokens: int):
    """An orchestrator with a draft model whose cost tables are ``verify`` (seconds by tokens) and ``draft``
    (seconds by lanes), and one auto request past its prefill per id in ``rids``: (orchestrator, states)."""
    from calid.decoding.modes import DecodeParams
    from calid.generation import GenerationRequest, SamplingParams
    from calid.orchestrator import Orchestrator

    class Tok:
        def decode(self, ids, **kw):
            return " ".join(map(str, ids))

    orch = Orchestrator(Tok(), frozenset(), max_position=4096, has_draft=True)
    for size, secs in verify.items():
        orch.observe_verify(size, secs)
    for lanes, secs in draft.items():
        orch.observe_draft(lanes, 1, secs)
    states = []
    for rid in rids:
        s = orch.start(orch.validate(GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=max_new_tokens),
                                                       request_id=rid, decode=DecodeParams(mode="auto", gamma=4))))
        s.stats.target_calls = 1
        states.append(s)
    return orch, states


def test_a_step_saves_what_its_tokens_spare_later_plain_steps():
    """A token of the request furthest behind spares a whole later step; one of a request ahead of it, its row."""
    rows = table({1: 0.075, 2: 0.096, 3: 0.117, 4: 0.138})  # a plain step of k requests: 75 ms + 21 ms a row
    reqs = [PlanInput(alpha=0.5, cap=4, remaining=96) for _ in range(4)]

    def saved_by(inputs, produced):
        return plan_group(inputs, rows, CostTable()).saved(produced)

    assert saved_by(reqs, [1, 1, 1, 1]) == pytest.approx(0.138)  # a plain step saves itself
    assert saved_by(reqs, [17, 17, 17, 1]) == pytest.approx(0.075 + 3 * 16 * 0.021 + 3 * 0.021)
    assert saved_by(reqs, [17, 17, 17, 17]) == pytest.approx(17 * 0.138)  # all together: whole steps
    assert saved_by(reqs[:1], [5]) == pytest.approx(5 * 0.075)  # one request: its tokens per second


@pytest.mark.parametrize("reqs", [
    [PlanInput(alpha=0.8, cap=6, remaining=40)],  # one request: drafts
    [PlanInput(alpha=0.1, cap=6, remaining=40)],  # one request: plain
    [PlanInput(alpha=0.8, cap=6, remaining=40 + k) for k in range(3)],  # several: drafts, priced over its spread
    [PlanInput(alpha=0.05, cap=6, remaining=40 + k) for k in range(3)],  # several: plain
])
@pytest.mark.parametrize("sliced", [False, True])
def test_a_group_plan_is_plan_steps_with_the_forecasts_step_saving_makes(reqs, sliced):
    """plan_group shares one plain step's terms between the plan and its forecasts: the same choices and numbers as
    planning and pricing each anew."""
    chosen = plan_steps(reqs, GPU_LIKE, CHEAP_DRAFT, 1, sliced=sliced)
    planned = plan_group(reqs, GPU_LIKE, CHEAP_DRAFT, 1, sliced=sliced)
    assert planned.chosen == chosen
    assert planned.forecast == pytest.approx(step_saving(chosen, reqs, GPU_LIKE, CHEAP_DRAFT, 1, sliced))
    assert planned.plain == pytest.approx(step_saving([AR] * len(reqs), reqs, GPU_LIKE, CHEAP_DRAFT, 1, sliced))


@settings(max_examples=200, deadline=None)
@given(alpha=st.floats(0.0, 1.0), cap=st.integers(0, 40), copy_n=st.integers(0, 40), held=st.floats(0.0, 1.0),
       gain=st.one_of(st.none(), st.floats(0.0, 8.0)), tree=st.one_of(st.none(), st.floats(0.0, 1.0)),
       setup=st.floats(0.0, 0.05), remaining=st.one_of(st.none(), st.integers(1, 200)),
       costs=st.sampled_from([(GPU_LIKE, CHEAP_DRAFT), (CPU_LIKE, CHEAP_DRAFT), (CPU_LIKE, CostTable())]),
       sliced=st.booleans())
def test_a_request_alone_is_planned_as_the_general_pricing_plans_it(alpha, cap, copy_n, held, gain, tree, setup,
                                                                    remaining, costs, sliced):
    """One request with the forward to itself takes a direct pricing (planning._plan_alone): the same choice,
    forecasts and saving as the general one, for every kind of option."""
    verify, draft = costs
    reqs = [PlanInput(alpha=alpha, cap=cap, lookahead_gain=gain, tree_alpha=tree, draft_setup_s=setup,
                      remaining=remaining, **copy(copy_n, held))]
    planned = plan_group(reqs, verify, draft, 0, sliced=sliced)
    step = _Step(reqs, verify, draft, 0, [AR], sliced)
    step.choose(0, reqs[0].options(draft.known))
    assert planned.chosen == step.plan
    assert planned.forecast == pytest.approx(step_saving(step.plan, reqs, verify, draft, 0, sliced))
    assert planned.plain == pytest.approx(step_saving([AR], reqs, verify, draft, 0, sliced))
    for produced in (0, 1, 5, 300):
        assert planned.saved([produced]) == pytest.approx(step.togo.start - step.togo([max(0.0, step.left[0]
                                                                                           - produced)]))


def test_the_guard_stops_copies_that_leave_one_request_behind_though_their_tokens_come_cheaper():
    """Four requests in a burst (Qwen 1.5B, 2-core CPU, in process): three copied far ahead, 30 ms a token
    against 34.5 in plain steps of four, and the fourth then decoded its last 58 tokens alone at 75 ms each:
    auto ran 0.87x ar. Judged by tokens per second the copies won; judged by what they spare later plain steps
    (rows, not steps: the fourth still needs every one of its steps) they lose, and the guard stops them."""
    orch, states = _auto_requests(  # verifying looks nearly free (a table that undercounts big forwards)
        {1: 0.075, 2: 0.096, 3: 0.117, 4: 0.138, 8: 0.140, 16: 0.145, 32: 0.150}, {1: 0.002, 4: 0.0025}, "abcd", 2000)
    drafted = []
    for _ in range(120):
        tasks = orch.draft_tasks(states)
        drafting = {t.request_id for t in tasks}
        for s in states:  # a, b and c take 5 tokens when they draft; d never more than 1
            n = 5 if s.req.request_id in drafting and s.req.request_id != "d" else 1
            s.output.extend([9] * n)
            s.token_ids.extend([9] * n)
        drafted.append(bool(tasks))
        orch.observe_step(0.45 if tasks else 0.138)
    summary = orch.guard.summary()
    assert summary["drafted4+@4"] < summary["plain@4"]  # 28 ms a token against 34.5: the copies' tokens came cheaper
    assert sum(drafted[40:]) <= 80 // 12  # past the first measures, only the guard's exploring steps draft


def test_the_guard_measures_plain_steps_first_and_judges_each_batch_size_apart():
    from calid.planning import GUARD_PROBE, StepGuard

    g = StepGuard()
    assert [g.allow(1, 2, _forecast(10.0, requests=1)) for _ in range(2 * GUARD_PROBE)].count(False) == 2  # probes
    loses = _guard_after(plain_ms=26.0, drafted_ms=40.0, forecast_ms=20.0, requests=4)
    assert not loses.allow(4, 2, _forecast(20.0))
    assert loses.allow(12, 2, _forecast(20.0, requests=12))  # nothing measured at 12 requests yet: the planner's call
    assert [guard_bucket(n) for n in (1, 8, 9, 12, 16, 17)] == [1, 8, 16, 16, 16, 32]


def test_an_orchestrator_stops_drafting_where_its_steps_measurably_lose():
    """The planner believes verification is nearly free (so it drafts); the steps it times say otherwise."""
    orch, states = _auto_requests({1: 0.020, 64: 0.021}, {1: 0.001, 16: 0.0011}, "ab", 500)
    drafted_steps = 0
    for step in range(60):
        tasks = orch.draft_tasks(states)
        drafted_steps += bool(tasks)
        for s in states:  # one token each, whatever was planned: the drafts never land
            s.output.append(9)
            s.token_ids.append(9)
        orch.observe_step(0.100 if tasks else 0.040)  # and drafting steps cost 2.5x
    assert orch.guard.overruled + orch.guard.unplanned > 40 and drafted_steps < 15
    assert orch.guard.unplanned > 20  # past the first measures most steps are not even planned (StepGuard.plans)


def test_the_guard_plans_only_where_drafting_steps_measurably_saved_more_and_still_explores():
    """A step not worth planning costs nothing beside its forward: at 16 requests the planner took 5-11 ms of a
    330 ms plain step, where the drafting steps it let through did no better than plain ones."""
    from calid.planning import GUARD_EXPLORE, StepGuard

    assert StepGuard().plans(4)  # nothing measured: plan
    loses = _guard_after(plain_ms=26.0, drafted_ms=30.0, forecast_ms=20.0)
    tie = _guard_after(plain_ms=26.0, drafted_ms=25.0)  # 4% cheaper: inside the margin
    wins = _guard_after(plain_ms=26.0, drafted_ms=20.0)
    for g in (loses, tie):
        assert [g.plans(4) for _ in range(2 * GUARD_EXPLORE)].count(True) == 2  # only the exploring steps
        assert g.unplanned == 2 * GUARD_EXPLORE - 2
        assert g.plans(2) and g.plans(12)  # other batch sizes are judged by their own steps
    assert all(wins.plans(4) for _ in range(2 * GUARD_EXPLORE)) and wins.unplanned == 0


def test_steps_that_prefill_a_new_request_are_not_timed_by_the_guard():
    """A new request's first step is its prompt's prefill (one forward when the prompt fits in the forward
    budget): seconds of it, one token out. Timed as a decode step, it made plain steps look 5x dearer than they
    are whenever requests kept arriving, and drafting look like a win."""
    from calid.decoding.modes import DecodeParams
    from calid.generation import GenerationRequest, SamplingParams
    from calid.orchestrator import Orchestrator

    class Tok:
        def decode(self, ids, **kw):
            return " ".join(map(str, ids))

    orch = Orchestrator(Tok(), frozenset(), max_position=512, has_draft=False)
    old, new = (orch.start(orch.validate(GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=50),
                                                          request_id=rid, decode=DecodeParams(mode="auto"))))
                for rid in "ab")
    old.stats.target_calls = 1
    for states, secs in (([old, new], 1.5), ([old], 0.03), ([old, new], 1.5)):
        orch.draft_tasks(states)
        for s in states:
            s.output.append(9)
            s.token_ids.append(9)
        orch.observe_step(secs)
    assert orch.guard.summary() == {"plain@1": 30.0}  # only the decode step of the old request alone


def test_the_verification_cap_is_the_best_size_if_every_draft_token_were_free_and_accepted():
    from calid.calibration import verification_cap

    proportional = CostTable([1, 2, 4, 8, 16], [0.0285, 0.0568, 0.0971, 0.2177, 0.2571])  # Qwen 1.5B, AMD EPYC
    cap, size = verification_cap(proportional)
    assert size == 16 and cap == pytest.approx(16 * 0.0285 / 0.2571)  # 1.77x, only with 15 accepted tokens
    assert verification_cap(CostTable([1, 2, 4], [0.03, 0.06, 0.12])) == (1.0, 1)  # k tokens cost k steps: none
    assert verification_cap(CostTable([1, 8], [0.03, 0.04]))[0] == pytest.approx(6.0)  # a GPU-like target
    assert verification_cap(CostTable()) == (1.0, 1)


def test_every_choice_yields_on_average_what_its_estimate_says():
    """A choice's mean yield (tokens(), read off the survival its spread is priced over) is its estimate's: a draft
    chain's and a tree's (1 - a^(g+1)) / (1 - a), a copy's 1 + S(1) + ... + S(g), and a Lookahead step's 1 + its
    mean gain, spread as one chance per node; a gain as deep as the nodes yields every node, no more."""
    r = PlanInput(alpha=0.7, cap=8, lookahead_gain=1.5, tree_alpha=0.8, **copy(5, 0.9))
    expected = {Choice("speculative", 6): expected_tokens(0.7, 6), Choice("tree", 3): expected_tokens(0.8, 3),
                Choice("ngram", 5): 1 + sum(r.ngram_survival[:5]), Choice("lookahead", 8): 2.5, AR: 1.0}
    for c, tokens in expected.items():
        assert r.tokens(c) == pytest.approx(tokens, rel=1e-9)
        assert list(r.survival(c)) == sorted(r.survival(c), reverse=True)
    deep = PlanInput(alpha=0.5, cap=4, lookahead_gain=6.0)
    assert deep.survival(Choice("lookahead", 4)) == (1.0,) * 4 and deep.tokens(Choice("lookahead", 4)) == 5.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.5, 40), max_size=3),
       st.lists(st.lists(st.tuples(st.floats(0.5, 40), st.floats(0.01, 1.0)), min_size=1, max_size=4), max_size=4),
       st.sampled_from([0.0, 1e-13, -1e-17]))
def test_the_spread_of_linear_costs_is_the_sum_of_the_means(certain, chains, crumb):
    """With every request's step weight 1, a cost to go is the sum of the tokens left, so its expectation is the
    sum of the means, however the chains' outcomes interleave, and also with an outcome of chance 0, one a
    rounding error below it, or a crumb past a chain's spent chance (which once emptied the sweep's queue)."""
    from calid.planning import _Spread

    fixed = []
    for outcomes in chains:
        total = sum(p for _, p in outcomes) or 1.0
        fixed.append(tuple((x, p / total) for x, p in outcomes) + ((max(x for x, _ in outcomes) + 1.0, crumb),))
    weights = [1.0] * (len(certain) + len(chains))
    got = _Spread(certain, fixed, weights, 0.0).area
    want = sum(certain) + sum(x * p for o in fixed for x, p in o if p > 0)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-9)
