"""Acceptance rules: given what the draft proposed and what the target says, what is kept.

Terms (per request, one verification step):
  * ``draft``  [g]     the g pending draft tokens x_1..x_g;
  * ``q``      [g, V]  the draft's (warped) distribution each x_i was drawn from;
  * ``p``      [g+1, V] the target's (warped) distribution before each x_i, plus one after x_g;
  * accepted   the longest prefix of the draft that is kept (0..g tokens);
  * recovered  the token the target supplies in place of the first rejected draft token;
  * bonus      the token the target supplies after all g draft tokens were accepted.
Every rule returns ``Verdict(accepted, next_token)``: the caller appends
``draft[:accepted] + [next_token]``. Temperature, top-k and top-p must be
applied identically to p and q (``sampling.warp``) before a rule sees them.

filter      (CALID Alg. 2, lossy)  the draft tokens are accepted and the target supplies
            the next token: a chain the draft was sure of all along, and ar (no draft).
            Chains with unsure tokens are decided by the target worker
            (calid.workers.target: the target picks each unsure token).
rollback    (BiLD, lossy)          accept up to the first draft token whose target
            NLL (plain softmax, before warping) exceeds the rollback threshold;
            the target replaces it with a token drawn from its warped p.
speculative (Leviathan et al. Alg. 1 / Chen et al., lossless)
            accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first
            rejection sample the recovered token from norm(max(0, p_i - q_i));
            if all are accepted sample the bonus token from p_g.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from calid.decoding.sampling import sample


@dataclass(frozen=True)
class Verdict:
    accepted: int
    next_token: int


@dataclass(frozen=True)
class RuleInput:
    draft: torch.Tensor  # [g] long
    q: torch.Tensor | None  # [g, V] fp32, rows sum to 1 (speculative only)
    p: torch.Tensor  # [g+1, V] fp32, rows sum to 1
    generator: torch.Generator | None = None
    target_nll: torch.Tensor | None = None  # [g] -log p_target(x_i) under the plain softmax (rollback)
    rollback_nll: float = float("inf")  # rollback threshold


def _target_token(x: RuleInput, row: int) -> int:
    """A token drawn from the target's warped distribution at ``row`` of p."""
    return int(sample(x.p[row][None], x.generator)[0])


def filter_rule(x: RuleInput) -> Verdict:
    # only the row after the last draft token is used, so p may be just that row [1, V]
    return Verdict(x.draft.shape[0], _target_token(x, -1))


def rollback_rule(x: RuleInput) -> Verdict:
    g = x.draft.shape[0]
    if g and x.target_nll is None:
        raise ValueError("rollback verification needs the target NLL of each draft token")
    too_unlikely = x.target_nll > x.rollback_nll if g else torch.zeros(0, dtype=torch.bool, device=x.p.device)  # [g]
    first = int(too_unlikely.nonzero()[0]) if bool(too_unlikely.any()) else g
    return Verdict(first, _target_token(x, first))


def speculative_rule(x: RuleInput) -> Verdict:
    g = x.draft.shape[0]
    if g == 0:
        return Verdict(0, _target_token(x, 0))  # nothing drafted: a plain target step
    if x.q is None:
        raise ValueError("speculative verification needs the draft distributions q")
    rows = torch.arange(g, device=x.p.device)
    p_x = x.p[rows, x.draft]  # [g]
    q_x = x.q[rows, x.draft]  # [g]
    u = torch.rand(g, generator=x.generator, device=x.p.device)  # [g]
    # accept when u < p/q  (written without division; q_x > 0 for a token the draft sampled)
    accept = u * q_x < p_x  # [g]
    first = int((~accept).nonzero()[0]) if not bool(accept.all()) else g
    if first == g:
        return Verdict(g, _target_token(x, g))  # bonus
    residual = (x.p[first] - x.q[first]).clamp_min(0.0)  # [V]
    total = residual.sum()
    # p == q exactly at this row would make the residual empty; rejection then has probability 0,
    # but guard against float round-off by falling back to p.
    dist = residual / total if total > 0 else x.p[first]
    return Verdict(first, int(sample(dist[None], x.generator)[0]))  # recovered


RuleFn = Callable[[RuleInput], Verdict]

RULES: dict[str, RuleFn] = {
    "filter": filter_rule,
    "rollback": rollback_rule,
    "speculative": speculative_rule,
}


def get_rule(name: str) -> RuleFn:
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(f"unknown acceptance rule {name!r} (known: {', '.join(RULES)})") from None
