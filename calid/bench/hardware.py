"""The physical limit a decoding benchmark is compared against.

Decoding one token reads every weight once, so a memory-bound decoder runs at
most ``bandwidth / weight bytes`` tokens per second per sequence step.
"""
from __future__ import annotations

import time

import torch


def memory_bandwidth_gbs(size_mb: int = 512, repeats: int = 5) -> float:
    """Best-of-N read bandwidth in GB/s, measured by summing a large fp32 tensor."""
    x = torch.ones(size_mb * (1 << 20) // 4, dtype=torch.float32)
    x.sum()  # fault pages in
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def decode_limit_tok_s(bandwidth_gbs: float, weight_bytes: int) -> float:
    return bandwidth_gbs * 1e9 / weight_bytes
