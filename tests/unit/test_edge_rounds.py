"""Edge drafting's pure side (calid.edge): checking a client's round, turning it into a draft, and the
client's drafter on a tiny random model."""
from __future__ import annotations

import math

import pytest
import torch

from calid.decoding.acceptance import RuleInput, speculative_rule
from calid.decoding.sampling import Warp, make_generator
from calid.edge import (EDGE_TOP_K, MAX_ROW, EdgeDrafter, EdgeRound, check_round, confident_prefix, dense_rows,
                        round_draft)
from calid.errors import InvalidRequestError
from calid.runtime.runner import ModelRunner, SeqInput

V = 100


def check(r: EdgeRound, mode="filter", max_draft=4, sampled=False):
    check_round(r, mode=mode, vocab_size=V, max_draft=max_draft, sampled=sampled)


@pytest.mark.parametrize("r, mode, sampled, words", [
    (EdgeRound([1, 2, 3, 4, 5], [0.9] * 5), "filter", False, "at most 4"),
    (EdgeRound([1, V], [0.9, 0.9]), "filter", False, "outside the vocabulary"),
    (EdgeRound([1, -1], [0.9, 0.9]), "speculative", False, "outside the vocabulary"),
    (EdgeRound([1, 2], [0.9]), "filter", False, "one confidence per token"),
    (EdgeRound([1, 2], [0.9, math.nan]), "filter", False, "no NaN"),
    (EdgeRound([1, 2], [0.9, 1.5]), "filter", False, "[0, 1]"),
    (EdgeRound([1, 2], [0.9, -0.1]), "filter", False, "[0, 1]"),
    (EdgeRound([1], [], []), "speculative", True, "draft distribution of every token"),
    (EdgeRound([1], [], [([1, 2], [0.5])]), "speculative", True, "pair 1..256 ids"),
    (EdgeRound([1], [], [(list(range(MAX_ROW + 1)), [1 / (MAX_ROW + 1)] * (MAX_ROW + 1))]), "speculative", True,
     "pair 1..256 ids"),
    (EdgeRound([1], [], [([1, 1], [0.5, 0.5])]), "speculative", True, "distinct"),
    (EdgeRound([1], [], [([1, V], [0.5, 0.5])]), "speculative", True, "distinct token ids"),
    (EdgeRound([1], [], [([1, 2], [0.5, 0.6])]), "speculative", True, "summing to 1"),
    (EdgeRound([1], [], [([1, 2], [math.nan, 1.0])]), "speculative", True, "summing to 1"),
    (EdgeRound([1], [], [([2, 3], [0.5, 0.5])]), "speculative", True, "no probability"),
    (EdgeRound([1], [], [([1, 3], [0.0, 1.0])]), "speculative", True, "no probability"),
])
def test_a_malformed_round_is_refused_with_its_reason(r, mode, sampled, words):
    with pytest.raises(InvalidRequestError) as e:
        check(r, mode, sampled=sampled)
    assert words in str(e.value)


def test_well_formed_rounds_pass():
    check(EdgeRound([], []))  # an empty round asks the target for the next token
    check(EdgeRound([1, 2, 3, 4], [1.0, 0.0, 0.5, 0.25]))
    check(EdgeRound([1, 2], []), "speculative")  # greedy speculative needs neither confidences nor rows
    check(EdgeRound([1], [], [([1, 7], [0.25, 0.75])]), "speculative", sampled=True)


def test_confident_prefix():
    assert confident_prefix([0.9, 0.8, 0.3, 0.95], 0.5) == 2
    assert confident_prefix([0.9, 0.8], 0.5) == 2
    assert confident_prefix([0.1, 0.0], 0.0) == 2  # threshold 0: every draft token clears it
    assert confident_prefix([1.0, 1.0], 1.0) == 0  # threshold 1: the target for every token


def test_filter_round_accepts_the_confident_prefix_and_asks_the_target_for_the_rest():
    early = round_draft("r", EdgeRound([4, 5], [0.9, 0.8]), mode="filter", threshold=0.5, vocab_size=V, sampled=False)
    assert (early.tokens, early.needs_target) == ([4, 5], False)  # early acceptance: no target call
    cut = round_draft("r", EdgeRound([4, 5, 6], [0.9, 0.2, 0.9]), mode="filter", threshold=0.5, vocab_size=V,
                      sampled=False)
    assert (cut.tokens, cut.needs_target) == ([4], True)  # the target generates the token after 4
    empty = round_draft("r", EdgeRound([], []), mode="filter", threshold=0.5, vocab_size=V, sampled=False)
    assert (empty.tokens, empty.needs_target) == ([], True)


def test_speculative_round_goes_to_verification_with_the_clients_rows():
    greedy = round_draft("r", EdgeRound([4, 5]), mode="speculative", threshold=0.4, vocab_size=V, sampled=False)
    assert (greedy.tokens, greedy.q, greedy.needs_target) == ([4, 5], None, True)
    r = EdgeRound([4, 9], [], [([4, 5], [0.5, 0.5]), ([9], [1.0])])
    sampled = round_draft("r", r, mode="speculative", threshold=0.4, vocab_size=V, sampled=True)
    assert sampled.q.shape == (2, V)
    assert sampled.q[0, 4] == 0.5 and sampled.q[0, 5] == 0.5 and sampled.q[1, 9] == 1.0
    assert torch.allclose(sampled.q.sum(-1), torch.ones(2)) and int((sampled.q > 0).sum()) == 3


def test_dense_rows_renormalizes_what_float32_rounding_left():
    q = dense_rows([([1, 2, 3], [0.3333, 0.3333, 0.3333])], V)
    assert abs(float(q.sum()) - 1.0) < 1e-6


def test_a_truncated_sparse_draft_keeps_speculative_sampling_exact():
    """The SDK draws a sampled draft from the top EDGE_TOP_K of its distribution and sends that row: the
    first emitted token must still follow the target's distribution p (chi-square, 3 dof, p = 0.001)."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    full_q = torch.tensor([0.05, 0.15, 0.3, 0.5])
    ids = [3, 2]  # a top-2 truncation of full_q, renormalized: the SDK's scheme with k = 2
    probs = (full_q[ids] / full_q[ids].sum()).tolist()
    q = dense_rows([(ids, probs)], 4)
    g, n = make_generator(0), 20000
    counts = torch.zeros(4)
    p_rows = torch.stack([p, torch.full((4,), 0.25)])
    drafts = torch.multinomial(q.expand(n, 4), 1, replacement=True, generator=g).squeeze(1)
    for d in drafts.tolist():
        v = speculative_rule(RuleInput(torch.tensor([d]), q, p_rows, g))
        counts[d if v.accepted else v.next_token] += 1
    chi2 = float(((counts - p * n) ** 2 / (p * n)).sum())
    assert chi2 < 16.27


# ---- the client's drafter ------------------------------------------------------------------------


@pytest.fixture()
def drafter(tiny_model):
    return EdgeDrafter(ModelRunner(tiny_model), frozenset())


def _greedy(model, prompt, n):
    runner, ids = ModelRunner(model), list(prompt)
    for _ in range(n):
        ids.append(int(runner.forward([SeqInput("g", runner.sync("g", ids))])[0][-1].argmax()))
    return ids[len(prompt):]


def test_greedy_draft_is_the_models_own_continuation(tiny_model, drafter):
    prompt = [5, 17, 3]
    r = drafter.draft("a", prompt, mode="speculative", max_draft=6, threshold=0.0, warp_params=Warp())
    assert r.tokens == _greedy(tiny_model, prompt, 6)
    assert len(r.confidence) == 6 and all(0.0 < c <= 1.0 for c in r.confidence) and r.rows == []
    # the next round starts from what the server kept: the cache rolls back by prefix match
    again = drafter.draft("a", prompt + r.tokens[:2], mode="speculative", max_draft=4, threshold=0.0,
                          warp_params=Warp())
    assert again.tokens == r.tokens[2:]


def test_a_draft_stops_after_its_first_unconfident_token(drafter):
    r = drafter.draft("a", [5, 17, 3], mode="filter", max_draft=8, threshold=1.0, warp_params=Warp())
    assert len(r.tokens) == 1  # threshold 1: no token is confident
    r = drafter.draft("b", [5, 17, 3], mode="filter", max_draft=8, threshold=0.0, warp_params=Warp())
    assert len(r.tokens) == 8
    mid = sorted(r.confidence)[3]
    r2 = drafter.draft("c", [5, 17, 3], mode="filter", max_draft=8, threshold=mid, warp_params=Warp())
    assert r2.tokens == r.tokens[: len(r2.tokens)]
    assert all(c >= mid for c in r2.confidence[:-1]) and (len(r2.tokens) == 8 or r2.confidence[-1] < mid)


def test_a_sampled_draft_sends_the_row_it_drew_from(drafter):
    w = Warp(temperature=1.0)
    r = drafter.draft("a", [5, 17, 3], mode="speculative", max_draft=5, threshold=0.0, warp_params=w,
                      generator=make_generator(1))
    assert len(r.rows) == len(r.tokens) == 5
    for token, (ids, probs) in zip(r.tokens, r.rows):
        assert len(ids) == min(EDGE_TOP_K, tiny_vocab(drafter)) and token in ids and probs[ids.index(token)] > 0
        assert abs(sum(probs) - 1.0) < 1e-4
    check_round(r, mode="speculative", vocab_size=tiny_vocab(drafter), max_draft=5, sampled=True)
    same = EdgeDrafter(drafter.runner, frozenset()).draft("b", [5, 17, 3], mode="speculative", max_draft=5,
                                                          threshold=0.0, warp_params=w, generator=make_generator(1))
    assert same.tokens == r.tokens  # seeded: reproducible


def tiny_vocab(drafter) -> int:
    return drafter.runner.vocab_size
