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
CPU it costs more), and a long prefill runs as many GEMMs as it has blocks (each reads the weights again:
a bf16 verification of 8 x 8 tokens spent 1.5x the whole ordinary step in its 8-row GEMMs).

Where the library is invariant in M itself for M >= 2 (oneDNN's bf16 GEMM on AVX-512 is, measured: only
M = 1 takes another kernel, a GEMV), ``rows="probe"`` finds that out at load time, per weight shape, on
random rows of M in PROBE_ROWS against the same rows at M = 2, and then runs every forward as GEMMs of at
most MAX_ROWS rows padded to at least 2 (one call for a decode or verification step); a shape that fails
the probe keeps fixed blocks. ``calid bench invariance`` measures both sides on the machine at hand.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_ROWS = 8
MAX_ROWS = 256  # probed GEMMs: at most this many rows per call (the probe covers M up to it)
PROBE_ROWS = (3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 128, 200, 255, 256)


class InvariantLinear(nn.Linear):
    """nn.Linear sharing the original parameters whose rows are computed in fixed blocks of ``rows``."""

    rows: int = DEFAULT_ROWS
    free_m: bool = False  # the probe found this shape invariant in M >= 2: GEMMs of 2..MAX_ROWS rows

    @classmethod
    def wrap(cls, linear: nn.Linear, rows: int = DEFAULT_ROWS, free_m: bool = False) -> "InvariantLinear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.rows, new.free_m = rows, free_m
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, k)
        m = flat.shape[0]
        if self.free_m:
            if m == 1:  # M = 1 would take the GEMV kernel
                return F.linear(torch.cat([flat, flat.new_zeros(1, k)]), self.weight, self.bias)[:1].view(*lead, -1)
            parts = [F.linear(flat[i: i + MAX_ROWS], self.weight, self.bias) for i in range(0, m, MAX_ROWS)]
            if parts[-1].shape[0] == 1:  # a last part of one row: compute it beside its predecessor's last row
                parts[-1] = F.linear(flat[m - 2:], self.weight, self.bias)[1:]
            return torch.cat(parts).view(*lead, self.out_features)
        b = self.rows
        blocks = -(-m // b)
        if blocks * b != m:
            flat = torch.cat([flat, flat.new_zeros(blocks * b - m, k)])
        out = torch.cat([F.linear(flat[i: i + b], self.weight, self.bias) for i in range(0, blocks * b, b)])
        return out[:m].view(*lead, self.out_features)


def m_invariant(weight: torch.Tensor, seed: int = 0) -> bool:
    """Whether GEMMs with this weight give a row the same bits at every M in PROBE_ROWS as at M = 2."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(max(PROBE_ROWS), weight.shape[1], generator=g).to(weight.device, weight.dtype)
    with torch.inference_mode():
        ref = F.linear(x[:2], weight)
        return all(torch.equal(F.linear(x[:m], weight)[:2], ref) for m in PROBE_ROWS)


def use_invariant_linears(model: nn.Module, rows: int | str = "probe") -> int:
    """Swap the model's linears (nn.Linear or a subclass wrapping its parameters) for InvariantLinear; return
    how many. ``rows``: a fixed block size, or "probe" (free M where m_invariant says so, else DEFAULT_ROWS)."""
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, InvariantLinear)]
    probed: dict[tuple, bool] = {}
    for name, linear in targets:
        free = False
        if rows == "probe":
            shape = (tuple(linear.weight.shape), linear.weight.dtype, linear.weight.device)
            if shape not in probed:
                probed[shape] = m_invariant(linear.weight)
            free = probed[shape]
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr,
                InvariantLinear.wrap(linear, DEFAULT_ROWS if rows == "probe" else rows, free))
    return len(targets)
