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
M = 1 takes another kernel, a GEMV), ``rows="probe"`` finds that out at load time, per weight shape: every
row of a GEMM of M rows must have the bits it has in a GEMM of 2 rows, for every M in PROBE_ROWS up to a
limit; the largest limit in ROW_LIMITS that holds becomes the shape's ``max_rows``, and every forward runs
as GEMMs of 2..max_rows rows (one call for a decode or verification step up to that size). Every row is
checked, not only the first: on a CPU with AMX (Sapphire Rapids), oneDNN's bf16 GEMM gives a few rows in
the middle of a GEMM of more than 32 rows other bits (rows 24 and 117 of 128 for a 576 x 576 weight), while
the first rows keep theirs. A shape with no limit of at least 8 keeps fixed blocks. ``calid bench
invariance`` measures both sides on the machine at hand.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_ROWS = 8
MAX_ROWS = 256  # probed GEMMs: at most this many rows per call (the probe covers M up to it)
PROBE_ROWS = tuple(range(2, 33)) + (33, 48, 63, 64, 65, 100, 127, 128, 129, 200, 255, 256)
ROW_LIMITS = (256, 128, 64, 32, 16, 8)  # the max_rows a probed shape may get, largest first
PROBE_TRIALS = 3  # GEMMs of other rows per probed M above 32 (on AMX, where oneDNN's bf16 kernel changes)
PROBE_COVER = 128  # and at every M, GEMMs enough to check at least this many rows


class InvariantLinear(nn.Linear):
    """nn.Linear sharing the original parameters whose rows are computed in fixed blocks of ``rows``."""

    rows: int = DEFAULT_ROWS
    max_rows: int = 0  # the probe found this shape invariant for 2 <= M <= max_rows: GEMMs of that many rows

    @classmethod
    def wrap(cls, linear: nn.Linear, rows: int = DEFAULT_ROWS, max_rows: int = 0) -> "InvariantLinear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.rows, new.max_rows = rows, max_rows
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, k)
        m = flat.shape[0]
        if self.max_rows:
            if m == 1:  # M = 1 would take the GEMV kernel
                return F.linear(torch.cat([flat, flat.new_zeros(1, k)]), self.weight, self.bias)[:1].view(*lead, -1)
            r = self.max_rows
            parts = [F.linear(flat[i: i + r], self.weight, self.bias) for i in range(0, m, r)]
            if parts[-1].shape[0] == 1:  # a last part of one row: compute it beside its predecessor's last row
                parts[-1] = F.linear(flat[m - 2:], self.weight, self.bias)[1:]
            return torch.cat(parts).view(*lead, self.out_features)
        b = self.rows
        blocks = -(-m // b)
        if blocks * b != m:
            flat = torch.cat([flat, flat.new_zeros(blocks * b - m, k)])
        out = torch.cat([F.linear(flat[i: i + b], self.weight, self.bias) for i in range(0, blocks * b, b)])
        return out[:m].view(*lead, self.out_features)


def max_invariant_rows(weight: torch.Tensor, seed: int = 0) -> int:
    """The largest limit R in ROW_LIMITS such that, for every M in PROBE_ROWS up to R, every row of a GEMM of
    M rows with this weight has the bits that row has in a GEMM of 2 rows (either position); 0: none.

    A kernel that accumulates in another order shows only where a row's sum lands near a bf16 rounding
    boundary (a few rows in a hundred), so each GEMM takes other rows, in another order, from a pool whose
    2-row bits are computed once, and every M is tried on at least PROBE_COVER rows (PROBE_TRIALS GEMMs above
    32): a kernel change at some M then shows in at least one of them. One GEMM per small M was not enough:
    on an AVX-512 CPU without native bf16, oneDNN's bf16 GEMMs of 4-8 rows give a 576 x 576 weight's rows
    other bits now and then, and a single GEMM of each missed it."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    pool = torch.randn(MAX_ROWS, weight.shape[1], generator=g).to(weight.device, weight.dtype)
    with torch.inference_mode():
        pairs = torch.cat([F.linear(pool[i: i + 2], weight) for i in range(0, MAX_ROWS, 2)])  # the 2-row bits
        if not torch.equal(F.linear(pool[1:3], weight), pairs[1:3]):  # a row's bits depend on its place in 2
            return 0
        good = 1
        for m in PROBE_ROWS:
            calls = max(PROBE_TRIALS if m > 32 else 1, -(-PROBE_COVER // m))
            tries = (torch.randperm(MAX_ROWS, generator=g)[:m].to(weight.device) for _ in range(calls))
            if not all(torch.equal(F.linear(pool.index_select(0, rows), weight), pairs.index_select(0, rows))
                       for rows in tries):
                break
            good = m
    return next((r for r in ROW_LIMITS if r <= good), 0)


def use_invariant_linears(model: nn.Module, rows: int | str = "probe") -> int:
    """Swap the model's linears (nn.Linear or a subclass wrapping its parameters) for InvariantLinear; return
    how many. ``rows``: a fixed block size, or "probe" (GEMMs of up to max_invariant_rows rows where that is at
    least 8, else blocks of DEFAULT_ROWS)."""
    targets = [
        (n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, InvariantLinear)
    ]
    probed: dict[tuple, int] = {}
    for name, linear in targets:
        limit = 0
        if rows == "probe":
            shape = (tuple(linear.weight.shape), linear.weight.dtype, linear.weight.device)
            if shape not in probed:
                probed[shape] = max_invariant_rows(linear.weight)
            limit = probed[shape]
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr,
                InvariantLinear.wrap(linear, DEFAULT_ROWS if rows == "probe" else rows, limit))
    return len(targets)
