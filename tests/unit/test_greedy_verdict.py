"""A greedy chain's verdict straight from the target's argmax (TargetWorker._greedy_verdict) is the verdict the
acceptance rules give on one-hot rows, token for token; and the helpers it rests on (argmax_rows, top1's NLL)
match torch's whole-vocabulary versions."""
from __future__ import annotations

import torch

from calid.decoding.acceptance import RuleInput, get_rule
from calid.decoding.confidence import top1
from calid.decoding.modes import DecodeParams
from calid.decoding.sampling import Warp, argmax_rows, warp
from calid.workers.messages import VerifyTask
from calid.workers.target import TargetWorker

V = 1000
GREEDY = Warp()


def _rule_verdict(mode: str, rows: torch.Tensor, draft: list[int]) -> tuple[list[int], int]:
    """The general path: one-hot target rows, one-hot draft rows (speculative), the mode's rule."""
    d = torch.tensor(draft, dtype=torch.long)
    q = torch.zeros(len(draft), V).scatter_(1, d[:, None], 1.0) if mode == "speculative" and draft else None
    v = get_rule("filter" if mode == "ar" else mode)(RuleInput(draft=d, q=q, p=warp(rows, GREEDY),
                                                            generator=torch.Generator().manual_seed(0)))
    return draft[: v.accepted] + [v.next_token], v.accepted


def test_greedy_verdicts_equal_the_rules_on_one_hot_rows():
    gen = torch.Generator().manual_seed(1)
    for trial in range(200):
        g = trial % 6
        rows = torch.randn(g + 1, V, generator=gen)
        top = rows.argmax(-1).tolist()
        cut = int(torch.randint(0, g + 1, (1,), generator=gen))  # the draft agrees with the target up to here
        draft = top[:cut] + [(t + 1) % V for t in top[cut:g]]
        for mode in ("speculative", "filter", "ar"):
            if mode == "ar" and g:
                continue
            verifying = mode == "speculative"
            task = VerifyTask("r", [5, 6, 7], 3, DecodeParams(mode=mode), GREEDY, 0, draft)
            got = (TargetWorker._greedy_verdict(task, rows if verifying else rows[-1:], verifying) if mode != "filter"
                   else TargetWorker(None)._filter_verdict(task, rows[-1:]))
            tokens, accepted = _rule_verdict(mode, rows if verifying else rows[-1:], draft)
            assert (got.tokens, got.accepted, got.top1) == (tokens, accepted, tokens[-1]), (mode, g, cut)
            if verifying:
                assert got.accepted == cut


def test_argmax_rows_takes_the_first_of_equal_maxima_like_torch():
    rows = torch.zeros(3, V)
    rows[0, [7, 9]] = 2.0
    rows[1, 500] = -1.0
    rows[2, [V - 1, 3]] = 1.0
    assert argmax_rows(rows) == rows.argmax(-1).tolist() == [7, 0, 3]
    assert argmax_rows(rows.to(torch.bfloat16)) == [7, 0, 3]  # not float32: torch's own argmax


def test_top1_nll_is_the_log_softmax_of_the_argmax():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2)) * 3
    token, nll = top1(logits)
    logp = torch.log_softmax(logits, -1)
    assert token.tolist() == logits.argmax(-1).tolist()
    assert torch.allclose(nll, -logp.gather(1, token[:, None]).squeeze(1), atol=1e-5)


def test_filter_decides_its_unsure_tokens_and_cuts_the_chain_where_the_target_differs():
    gen = torch.Generator().manual_seed(2)
    worker = TargetWorker(None)
    committed = [5, 6, 7]
    for trial in range(200):
        g = 1 + trial % 7
        rows = torch.randn(g + 1, V, generator=gen)  # the target's row before each draft token, and after the last
        top = rows.argmax(-1).tolist()
        draft = [(t + 1) % V if torch.rand(1, generator=gen) < 0.5 else t for t in top[:g]]  # about half agree
        unsure = sorted({int(i) for i in torch.randint(0, g, (2,), generator=gen)})
        task = VerifyTask("r", committed, 3, DecodeParams(mode="filter"), GREEDY, 0, draft, unsure=tuple(unsure))
        got = worker._filter_verdict(task, rows[[*unsure, g]])  # the rows the worker asks llama.cpp for
        cut = next((i for i in unsure if draft[i] != top[i]), None)
        if cut is None:  # the target agreed at every unsure token: the whole chain, then its token after it
            assert (got.tokens, got.accepted) == ([*draft, top[g]], g)
        else:  # sure tokens stand whatever the target says; the first unsure one it differs at is its own
            assert (got.tokens, got.accepted) == ([*draft[:cut], top[cut]], cut)
        assert got.decided == tuple(i for i in unsure if i < got.accepted) and got.proposed == g
