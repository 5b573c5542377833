"""Batch-invariant linears: a row's output depends only on that row, never on how many rows share the call.

Why: BLAS libraries pick a kernel (and a reduction order) by the number of rows M. Measured with torch 2.13
on this project's CPUs: MKL's fp32 GEMM gives a row different bits at almost every M from 1 to 64, and
oneDNN's bf16 GEMM gives M = 1 (a GEMV) different bits from M >= 2 on large matrices (the LM head). A
verification forward of k tokens then rounds differently from k one-token steps, and a request's logits
move when other requests share its batch; a near-tie flips and "lossless" speculative decoding departs
from ``ar`` (SmolLM2 in bf16: logits moved by up to 0.48).

The fix, exact by construction: every matmul runs in GEMMs of exactly ``rows`` rows. A forward's rows
are cut into blocks of ``rows`` (the last one padded with zeros, whose outputs are dropped), so each row
always meets the same kernel with the same reduction order, whatever else is in the forward. Each block is
one ``F.linear`` call (a batched GEMM over a stride-0 view of the weight would copy the weight per call:
measured, two thirds of a bf16 decode step).

The block size is a cost trade-off, not a correctness one: one row alone pays for ``rows`` (a GEMM of
``rows`` rows costs about one GEMV when the weights' bandwidth bounds it, as in bf16; in fp32 on a 2-core
CPU it costs more), and a long prefill runs as many GEMMs as it has blocks. ``calid bench invariance``
measures both sides on the machine at hand.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_ROWS = 8


class InvariantLinear(nn.Linear):
    """nn.Linear sharing the original parameters whose rows are computed in fixed blocks of ``rows``."""

    rows: int = DEFAULT_ROWS

    @classmethod
    def wrap(cls, linear: nn.Linear, rows: int = DEFAULT_ROWS) -> "InvariantLinear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.rows = rows
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, k)
        m, b = flat.shape[0], self.rows
        blocks = -(-m // b)
        if blocks * b != m:
            flat = torch.cat([flat, flat.new_zeros(blocks * b - m, k)])
        out = torch.cat([F.linear(flat[i: i + b], self.weight, self.bias) for i in range(0, blocks * b, b)])
        return out[:m].view(*lead, self.out_features)


def use_invariant_linears(model: nn.Module, rows: int = DEFAULT_ROWS) -> int:
    """Swap the model's linears (nn.Linear or a subclass wrapping its parameters) for InvariantLinear; return
    how many."""
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, InvariantLinear)]
    for name, linear in targets:
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, InvariantLinear.wrap(linear, rows))
    return len(targets)
