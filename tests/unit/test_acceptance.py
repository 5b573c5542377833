"""Acceptance rules: exact hand-built cases, seeded determinism, and the lossless property."""
import math

import pytest
import torch

from calid.decoding.acceptance import RuleInput, Verdict, get_rule, speculative_rule
from calid.decoding.confidence import Threshold, top1
from calid.decoding.sampling import make_generator

V = 4


def onehot(*tokens):
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def dist(*rows):
    return torch.tensor(rows, dtype=torch.float32)


# ---- confidence ---------------------------------------------------------------

def test_top1_nll_and_threshold_forms():
    logits = torch.log(dist([0.7, 0.2, 0.1, 0.0], [0.25, 0.25, 0.25, 0.25]))
    token, nll = top1(logits)
    assert token.tolist()[0] == 0
    assert nll.tolist() == pytest.approx([-math.log(0.7), -math.log(0.25)], rel=1e-5)
    t = Threshold.from_prob(0.5)
    assert t.nll == pytest.approx(math.log(2)) and t.prob == pytest.approx(0.5)
    assert t.confident(nll).tolist() == [True, False]
    assert Threshold.always().confident(nll).all() and not Threshold.never().confident(nll).any()


# ---- hand-built verdicts ------------------------------------------------------

def test_filter_accepts_all_drafts_and_takes_target_next():
    x = RuleInput(draft=torch.tensor([2, 1]), q=None, p=onehot(0, 0, 3))
    assert get_rule("filter")(x) == Verdict(2, 3)


def test_rollback_stops_at_first_token_the_target_finds_unlikely():
    draft = torch.tensor([2, 0, 1])
    target_nll = torch.tensor([0.2, 3.0, 0.1])  # the second draft token is unlikely for the target
    p = onehot(2, 1, 1, 3)  # warped (greedy) target rows
    strict = RuleInput(draft, None, p, target_nll=target_nll, rollback_nll=2.0)
    assert get_rule("rollback")(strict) == Verdict(1, 1)  # keep [2], target replaces 0 with 1
    lenient = RuleInput(draft, None, p, target_nll=target_nll, rollback_nll=5.0)
    assert get_rule("rollback")(lenient) == Verdict(3, 3)  # all kept, bonus from the last row


def test_speculative_greedy_accepts_matching_prefix_then_target_token():
    x = RuleInput(draft=torch.tensor([1, 2, 3]), q=onehot(1, 2, 3), p=onehot(1, 2, 0, 2))
    assert speculative_rule(x) == Verdict(2, 0)  # third draft token rejected, target says 0


def test_speculative_greedy_all_accepted_gives_bonus():
    x = RuleInput(draft=torch.tensor([1, 2]), q=onehot(1, 2), p=onehot(1, 2, 3))
    assert speculative_rule(x) == Verdict(2, 3)


def test_speculative_rejects_token_the_target_never_produces():
    x = RuleInput(draft=torch.tensor([0]), q=dist([0.9, 0.1, 0, 0]), p=dist([0, 0.5, 0.5, 0], [1, 0, 0, 0]),
                  generator=make_generator(0))
    v = speculative_rule(x)
    assert v.accepted == 0 and v.next_token in (1, 2)


def test_speculative_always_accepts_when_p_dominates_q():
    x = RuleInput(draft=torch.tensor([1]), q=dist([0.5, 0.5, 0, 0]), p=dist([0.2, 0.8, 0, 0], [0, 0, 1, 0]),
                  generator=make_generator(3))
    assert speculative_rule(x) == Verdict(1, 2)


def test_seeded_speculative_is_deterministic():
    torch.manual_seed(0)
    q, p = torch.rand(3, V).softmax(-1), torch.rand(4, V).softmax(-1)
    draft = torch.tensor([0, 1, 2])
    run = lambda seed: [speculative_rule(RuleInput(draft, q, p, make_generator(seed))) for _ in range(1)]
    assert run(5) == run(5)


def test_unknown_rule_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown acceptance rule 'nope'"):
        get_rule("nope")


# ---- lossless: outputs follow the target distribution ---------------------------

P = torch.tensor([0.1, 0.2, 0.3, 0.4])
Q = torch.tensor([0.4, 0.3, 0.2, 0.1])
N = 20000
CHI2_P001_DF3 = 16.27


def first_token_counts(rule, seed=0):
    """Draft one token from Q, verify against P; count the first emitted token."""
    g = make_generator(seed)
    counts = torch.zeros(V)
    drafts = torch.multinomial(Q.expand(N, V), 1, replacement=True, generator=g).squeeze(1)
    p_rows = torch.stack([P, torch.full((V,), 1 / V)])
    for d in drafts.tolist():
        v = rule(RuleInput(torch.tensor([d]), Q[None], p_rows, g))
        counts[d if v.accepted >= 1 else v.next_token] += 1
    return counts


def chi2(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_speculative_output_follows_target_distribution():
    assert chi2(first_token_counts(speculative_rule), P) < CHI2_P001_DF3


def test_statistical_test_catches_a_wrong_rule():
    def wrong_rule(x: RuleInput) -> Verdict:  # resamples from p instead of the residual
        v = speculative_rule(x)
        if v.accepted < x.draft.shape[0]:
            return Verdict(v.accepted, int(torch.multinomial(x.p[v.accepted], 1, generator=x.generator)))
        return v

    assert chi2(first_token_counts(wrong_rule), P) > CHI2_P001_DF3


def test_a_fixed_proposal_verified_as_a_one_hot_draft_follows_the_target():
    """An n-gram draft is not sampled: it proposes one token whatever the seed. Verified with a one-hot draft
    row (accept with probability p(x), else resample from p without x), the emitted token still follows P."""
    g = make_generator(1)
    p_rows = torch.stack([P, torch.full((V,), 1 / V)])
    for proposal in (3, 0):  # the target's likeliest token, and its least likely
        counts = torch.zeros(V)
        for _ in range(N):
            v = speculative_rule(RuleInput(torch.tensor([proposal]), onehot(proposal), p_rows, g))
            counts[proposal if v.accepted >= 1 else v.next_token] += 1
        assert chi2(counts, P) < CHI2_P001_DF3, proposal
