"""Measure a runner's forward costs once, so the planner (calid.planning) starts from real numbers.

Live timings refine them afterwards (Orchestrator.observe_verify / observe_draft).
"""
from __future__ import annotations

import time

from calid.planning import CostTable
from calid.runtime.runner import SeqInput

VERIFY_SIZES = (1, 2, 4, 8, 16)
DRAFT_BATCHES = (1, 2, 4, 8)
CONTEXT = 64  # tokens cached before the timed forwards, like a request past its prompt


def _timed(runner, inputs) -> float:
    start = time.perf_counter()
    runner.forward(inputs)
    return time.perf_counter() - start


def verify_costs(runner, sizes=VERIFY_SIZES, repeats: int = 2) -> CostTable:
    """Seconds of one target forward of ``n`` new tokens after a cached context (best of ``repeats``)."""
    table, seq = CostTable(), ("__calibrate__", "verify")
    v = runner.vocab_size
    prefix = [(7 * i + 3) % v for i in range(CONTEXT)]
    try:
        runner.forward([SeqInput(seq, prefix)])
        for n in sizes:
            if CONTEXT + n >= runner.max_position:
                break
            best = float("inf")
            for _ in range(repeats):
                runner.truncate(seq, CONTEXT)
                best = min(best, _timed(runner, [SeqInput(seq, [(5 * i + 1) % v for i in range(n)],
                                                          logits_at=list(range(n)))]))
            table.observe(n, best)
    finally:
        runner.release(seq)
    return table


def draft_costs(runner, batches=DRAFT_BATCHES) -> CostTable:
    """Seconds of one draft step (one new token for each of ``b`` sequences)."""
    table = CostTable()
    seqs = [("__calibrate__", "draft", i) for i in range(max(batches))]
    v = runner.vocab_size
    prefix = [(11 * i + 2) % v for i in range(CONTEXT)]
    try:
        runner.forward([SeqInput(s, prefix) for s in seqs])
        for b in batches:
            for s in seqs[:b]:
                runner.truncate(s, CONTEXT)
            table.observe(b, _timed(runner, [SeqInput(s, [1]) for s in seqs[:b]]))
    finally:
        for s in seqs:
            runner.release(s)
    return table
