"""Measure a runner's forward costs once, so the planner (calid.planning) starts from real numbers.

Live timings refine them afterwards (Orchestrator.observe_verify / observe_draft).
"""
from __future__ import annotations

import time

from calid.decoding.modes import DecodeParams
from calid.planning import CostTable
from calid.runtime.runner import SeqInput

# up to an n-gram copy's length (calid.decoding.ngram.MAX_CHAIN), densely where the cost curve is not smooth: on a
# 2-core CPU, llama.cpp's K-quant matmul switches to 16-row tiles at 8 rows, so 9-15 tokens cost more than 16
# (Qwen 1.5B, all rows' logits: 7 tokens 169 ms, 8: 234, 12: 293, 15: 337, 16: 283), which sizes 8 and 16 alone
# would interpolate as cheaper than they are
VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 20, 24, 32)
DRAFT_BATCHES = (1, 2, 4, 8)
CONTEXT = 64  # tokens cached before the timed forwards, like a request past its prompt
PROMPT = 160  # tokens of a prompt both models prefill (filter_cap's prefill ratio): a chat prompt's length


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


def prefill_cost(runner, tokens: int = CONTEXT) -> float:
    """Seconds per token of prefilling one sequence in a chunk of ``tokens`` (a draft's catch-up)."""
    seq, v = ("__calibrate__", "prefill"), runner.vocab_size
    try:
        return _timed(runner, [SeqInput(seq, [(7 * i + 5) % v for i in range(tokens)])]) / tokens
    finally:
        runner.release(seq)


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


def filter_cap(target, draft, batch: int, gamma: int = DecodeParams.gamma, repeats: int = 3) -> dict[str, float]:
    """The most CALID filter can gain over ar at ``batch`` sequences on these runners, measured.

    At best the draft makes every token and the target only reads them into its cache, at its cheapest: in one
    forward of ``gamma`` tokens per sequence per draft chain (``catch_up_s``) or, where confident chains pile up
    into long runs, at the rate it prefills a prompt (``read_s``, the lesser of the two). So per output token filter
    costs at least the draft's step / batch plus that, where ar costs the target's step / batch: ``cap`` = ar /
    (draft + read), a bound up to timing noise (one request, 2-core EPYC, Qwen pair: 1.60x against 1.69x measured in
    the same run; timed with the gamma forward alone it read 0.91x against 1.87x, whose catch-ups ran 20-40 tokens).
    ``prefill_ratio``: the draft's time to prefill a prompt over the target's (both models read every prompt in
    filter, where ar's target alone does), which caps filter on whole requests below its cap on decoding
    (whole_request_cap)."""
    seqs = [("__filter_cap__", i) for i in range(batch)]
    prefix = [(13 * i + 5) % target.vocab_size for i in range(CONTEXT)]

    def per_token(runner, tokens: int) -> float:
        runner.forward([SeqInput(s, prefix) for s in seqs])
        out = float("inf")
        for _ in range(repeats):
            for s in seqs:
                runner.truncate(s, CONTEXT)
            out = min(out, _timed(runner, [SeqInput(s, [1 + j for j in range(tokens)]) for s in seqs]))
        for s in seqs:
            runner.release(s)
        return out / (batch * tokens)

    ar, drafted, catch_up = per_token(target, 1), per_token(draft, 1), per_token(target, gamma)
    prompt = min(PROMPT, target.max_position - 1, draft.max_position - 1)
    prefill = {r: min(prefill_cost(r, prompt) for _ in range(2)) for r in (target, draft)}
    read = min(catch_up, prefill[target])
    return {"ar_s": ar, "draft_s": drafted, "catch_up_s": catch_up, "read_s": read, "cap": ar / (drafted + read),
            "prefill_ratio": prefill[draft] / prefill[target]}


def whole_request_cap(decoding_cap: float, prefill_share: float, prefill_ratio: float) -> float:
    """filter's most over ar on whole requests: ar spends ``prefill_share`` of its time prefilling, which filter
    spends too and, on the draft, ``prefill_ratio`` as much again; the rest it decodes at most ``decoding_cap``
    times as fast (filter_cap)."""
    return 1 / (prefill_share * (1 + prefill_ratio) + (1 - prefill_share) / decoding_cap)


def verification_cap(verify: CostTable) -> tuple[float, int]:
    """The most lossless drafting can gain over plain steps with one request on this target, and at which
    forward size: max over measured sizes k of k x cost(1) / cost(k), the speed-up if every one of k - 1 draft
    tokens were accepted and drafting cost nothing (an n-gram copy). Below 1.0 at every size: no draft, however
    good, pays here (a 2-core CPU where two tokens cost 2x one: Qwen 1.5B on llama.cpp, AMD EPYC, AVX-512)."""
    one = verify(1)
    if not verify.known or one <= 0:
        return 1.0, 1
    cap, fewer = max((k * one / t, -k) for k, t in verify.as_dict().items() if t > 0)  # a tie: the smaller size
    return cap, -fewer
