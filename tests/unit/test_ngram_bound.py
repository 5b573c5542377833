"""The n-gram oracle bound (calid.bench.ngram_bound) on hand-built requests with hand-computed costs."""
import pytest

from calid.bench.ngram_bound import ngram_bound
from calid.planning import CostTable

PROMPT = [10, 11, 12, 13, 14, 15, 16]
COPY = [10, 11, 12, 13, 14, 15, 99]  # copies the prompt's start, then leaves it


def cheap(k: int) -> float:  # verifying extra tokens nearly free (a GPU's shape)
    return 1.0 + 0.1 * (k - 1)


def test_the_oracle_verifies_the_confirmed_copy_in_one_forward():
    # at 0 and 1 no earlier (x, 10) / (10, 11) exists: plain steps; at 2, (10, 11) matches the prompt's start and
    # proposes 12..15 (the last output token is left to the target); ar confirms all 4: one forward of 5 tokens
    b = ngram_bound([PROMPT], [COPY], cheap)
    assert (b.tokens, b.copied) == (7, 4)
    assert b.ar_s == pytest.approx(7.0) and b.oracle_s == pytest.approx(1 + 1 + 1.4)
    assert b.ratio == pytest.approx(7 / 3.4)


def test_where_verifying_costs_what_plain_steps_do_the_bound_is_one():
    b = ngram_bound([PROMPT], [COPY], lambda k: float(k))
    assert b.copied == 0 and b.ratio == pytest.approx(1.0)


def test_tokens_ar_would_not_pick_are_never_verified():
    b = ngram_bound([PROMPT], [[10, 11, 50, 51, 52, 53, 54]], cheap)  # the proposal 12.. is wrong from its first
    assert b.copied == 0 and b.ratio == pytest.approx(1.0)


def test_the_cap_and_the_cost_curve_choose_the_prefix():
    # cap 2: 12, 13 copied (the target adds 14), then 15 (the last output token is the target's): 3 copied
    assert ngram_bound([PROMPT], [COPY], cheap, cap=2).copied == 3
    # a 3-token forward costs as much as 3 plain steps, 5 tokens only 2.5: the oracle takes all 4 confirmed
    table = CostTable()
    for size, secs in {1: 1.0, 3: 3.0, 5: 2.5}.items():
        table.observe(size, secs)
    b = ngram_bound([PROMPT], [COPY], table)
    assert b.copied == 4 and b.oracle_s == pytest.approx(1 + 1 + 2.5)


def test_several_requests_add_up_and_bad_input_is_refused():
    b = ngram_bound([PROMPT, PROMPT], [COPY, [1, 2]], cheap)
    assert b.tokens == 9 and b.ar_s == pytest.approx(9.0)
    assert ngram_bound([], [], cheap).ratio == 1.0
    with pytest.raises(ValueError, match="2 prompts but 1 outputs"):
        ngram_bound([PROMPT, PROMPT], [COPY], cheap)
    with pytest.raises(ValueError, match="cost"):
        ngram_bound([PROMPT], [COPY], lambda k: 0.0)
    with pytest.raises(ValueError, match="cap"):
        ngram_bound([PROMPT], [COPY], cheap, cap=-1)
