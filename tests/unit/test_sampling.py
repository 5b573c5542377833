import math

import pytest
import torch

from calid.decoding.sampling import Warp, make_generator, sample, warp


def test_greedy_is_one_hot_on_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.9, 0.0]])
    assert warp(logits, Warp()).tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_temperature_scales_logits():
    logits = torch.tensor([[0.0, math.log(3.0)]])
    assert warp(logits, Warp(temperature=1.0))[0].tolist() == pytest.approx([0.25, 0.75])
    p = warp(logits, Warp(temperature=0.5))  # 1 : 9
    assert p[0].tolist() == pytest.approx([0.1, 0.9])


def test_top_k_keeps_k_largest_exactly():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))
    assert warp(logits, Warp(temperature=1.0, top_k=2))[0].tolist() == pytest.approx([0, 4 / 7, 0, 3 / 7])


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))
    # sorted: .4 .3 .2 .1 -> mass before each: 0 .4 .7 .9 ; p=0.6 keeps .4 and .3
    assert warp(logits, Warp(temperature=1.0, top_p=0.6))[0].tolist() == pytest.approx([0, 4 / 7, 0, 3 / 7])
    # p=0.7 keeps exactly .4 .3 (mass .7 reached before .2)
    assert warp(logits, Warp(temperature=1.0, top_p=0.7))[0].tolist() == pytest.approx([0, 4 / 7, 0, 3 / 7])
    # a tiny p keeps the top-1 alone
    assert warp(logits, Warp(temperature=1.0, top_p=0.01))[0].tolist() == pytest.approx([0, 1, 0, 0])


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    probs = torch.full((1, 50), 1 / 50)
    draw = lambda seed: [int(sample(probs, g)[0]) for g in [make_generator(seed)] for _ in range(20)]
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_samples_follow_the_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    g = make_generator(0)
    n = 20000
    counts = torch.bincount(torch.multinomial(probs.expand(n, -1), 1, generator=g).squeeze(-1), minlength=4)
    expected = probs[0] * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # p = 0.001 for 3 degrees of freedom
