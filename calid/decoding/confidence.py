"""Draft confidence (CALID Eq. 1).

The confidence of a draft step is the probability of its top-1 token, or
equivalently its negative log-likelihood ``nll = -log p(t1)``. A threshold is
stored as an NLL: a step is *confident* when ``nll <= threshold.nll`` (higher
probability = lower NLL). ``Threshold.from_prob(0.6)`` and
``Threshold(nll=0.51)`` are the same thing. ``Threshold.always()`` (infinite
NLL bound) makes every step confident; ``Threshold.never()`` (a negative
bound, below any NLL) makes none confident.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from calid.decoding.sampling import argmax_rows


@dataclass(frozen=True)
class Threshold:
    nll: float  # confident when top-1 NLL <= nll

    @classmethod
    def from_prob(cls, p: float) -> "Threshold":
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"confidence probability must be in [0, 1], got {p}")
        return cls(math.inf if p == 0.0 else -math.log(p))

    @classmethod
    def always(cls) -> "Threshold":
        return cls(math.inf)

    @classmethod
    def never(cls) -> "Threshold":
        return cls(-1.0)  # an NLL is never negative

    @property
    def prob(self) -> float:
        return 0.0 if math.isinf(self.nll) else math.exp(-self.nll)

    def confident(self, nll: torch.Tensor) -> torch.Tensor:
        return nll <= self.nll


def top1(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (top-1 token [N], NLL of that token [N]) under the unwarped softmax."""
    logits = logits.float()
    token = torch.tensor(argmax_rows(logits), dtype=torch.long, device=logits.device)  # [N]
    top = logits.gather(-1, token[:, None]).squeeze(-1)  # [N]
    return token, torch.logsumexp(logits, dim=-1) - top  # -log softmax(top): no [N, V] log-probabilities
