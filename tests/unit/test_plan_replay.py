"""The planner replay (calid.bench.plan_replay) on hand-built bursts with hand-built cost tables."""
import pytest

from calid.bench.plan_replay import replay_burst
from calid.planning import AR, Choice, CostTable, split_cost

PROMPT = list(range(100, 140))  # 40 distinct tokens
COPY = PROMPT[:30] + [7, 8, 9]  # the answer restates the prompt's first 30 tokens, then leaves it


def table(points: dict[int, float]) -> CostTable:
    t = CostTable()
    for size, seconds in points.items():
        t.observe(size, seconds)
    return t


GPU_LIKE = table({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2, 32: 1.4, 64: 1.8})  # more tokens nearly free
PROPORTIONAL = table({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0, 32: 32.0, 64: 64.0})  # k tokens cost k steps


def test_a_copy_that_holds_is_verified_in_few_steps_and_every_token_is_ar_s():
    r = replay_burst([PROMPT], [COPY], GPU_LIKE)
    assert r.tokens == len(COPY) - 1 and r.ar_steps == len(COPY) - 1
    assert r.ar_s == pytest.approx(len(COPY) - 1)  # plain steps of 1 s
    assert 0 < r.copied < r.tokens and r.steps < r.ar_steps
    assert r.ratio == pytest.approx(r.ar_s / r.planned_s) and r.ratio > 3


def test_where_verifying_costs_what_plain_steps_do_nothing_is_drafted():
    r = replay_burst([PROMPT], [COPY], PROPORTIONAL)
    assert r.copied == 0 and r.steps == r.ar_steps and r.ratio == pytest.approx(1.0)


def test_an_answer_with_nothing_to_copy_decodes_as_ar():
    fresh = list(range(500, 530))
    r = replay_burst([PROMPT], [fresh], GPU_LIKE)
    assert r.copied == 0 and r.ratio == pytest.approx(1.0)


def test_a_wrong_copy_costs_its_verification_and_yields_only_the_target_s_token():
    """A planner that always verifies 4 copied tokens: where the copy breaks, the step still yields ar's token, and
    the replay pays the whole 5-token forward."""
    four = lambda inputs, verify, sliced: [Choice("ngram", min(4, r.ngram)) if r.ngram else AR for r in inputs]
    answer = PROMPT[:3] + [1, 2, 3, 4, 5, 6]  # copies 3 prompt tokens, then every later copy is wrong
    r = replay_burst([PROMPT], [answer], PROPORTIONAL, planner=four)
    assert r.tokens == len(answer) - 1
    assert r.copied <= 2  # at most the prompt tokens after the first
    assert r.ratio < 1.0  # 5-token forwards at 5 s that yield 1-2 tokens


def test_a_burst_is_timed_as_the_target_slices_it_and_shrinks_as_requests_finish():
    short, long = COPY[:5], COPY
    plain = lambda inputs, verify, sliced: [AR] * len(inputs)
    r = replay_burst([PROMPT, PROMPT], [short, long], PROPORTIONAL, planner=plain)
    # 4 steps of both (2 s each), then the long one alone for 28 more
    assert r.ar_s == pytest.approx(4 * 2.0 + 28 * 1.0) and r.planned_s == pytest.approx(r.ar_s)
    assert r.ar_steps == r.steps == 32
    many = replay_burst([PROMPT] * 3, [COPY] * 3, GPU_LIKE)
    assert many.ar_s == pytest.approx(32 * split_cost([1, 1, 1], GPU_LIKE))
    assert many.ratio > 1.0 and many.copied > 0


def test_bad_bursts_are_refused():
    with pytest.raises(ValueError, match="2 prompts but 1 outputs"):
        replay_burst([PROMPT, PROMPT], [COPY], GPU_LIKE)
    with pytest.raises(ValueError, match="no timings"):
        replay_burst([PROMPT], [COPY], CostTable())
    with pytest.raises(ValueError, match="longer than max_new_tokens=4"):
        replay_burst([PROMPT], [COPY], GPU_LIKE, max_new_tokens=4)


def test_foresight_verifies_only_tokens_that_hold_and_guessing_pays_for_the_rest():
    """Copies that break at every renamed token: the guessing planner verifies tokens that fail; told each copy's
    yield, it verifies only what holds and takes no longer for it."""
    renamed = [t + 1000 if t % 7 == 0 else t for t in PROMPT[:30]]  # the restated prompt with every 7th token renamed
    answer = renamed + PROMPT[30:36]
    guessed = replay_burst([PROMPT], [answer], GPU_LIKE)
    known = replay_burst([PROMPT], [answer], GPU_LIKE, foresight=True)
    assert guessed.verified > guessed.copied > 0
    assert known.verified == known.copied >= guessed.copied
    assert known.tokens == guessed.tokens and known.planned_s <= guessed.planned_s
    plain = replay_burst([PROMPT], [answer], PROPORTIONAL, foresight=True)  # even known yields do not pay here
    assert plain.copied == 0 and plain.ratio == pytest.approx(1.0)


def test_waves_replayed_one_after_the_other_add_their_counts_and_times():
    first, second = replay_burst([PROMPT], [COPY], GPU_LIKE), replay_burst([PROMPT], [[5, 6, 7, 8]], GPU_LIKE)
    both = first + second
    assert both.requests == 2 and both.tokens == first.tokens + 3 and both.ar_steps == first.ar_steps + 3
    assert both.copied == first.copied and both.planned_s == pytest.approx(first.planned_s + second.planned_s)
    assert first.ratio > both.ratio > second.ratio == pytest.approx(1.0)  # nothing to copy in the second wave
