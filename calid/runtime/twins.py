"""Twins: sequences of one forward that repeat another's prefill, fed once and forked.

The ``n`` choices of one prompt arrive together as ``n`` sequences with the same ids; so do requests that
share a long system prompt. Their prefills are the same computation. A runner feeds the first (the
*leader*) whole; each *twin* then gets a fork of the leader's KV cache over the new ids they share, the
leader's logits at the rows both asked for, and only its own tail is fed (in a second, small forward: a
speculative request's first target call is the prompt plus a draft token that differs by choice). Only
prefill-sized sharing counts (``MIN_TWIN_TOKENS``): a fork copies the stream, which a decode step would
not repay.
"""
from __future__ import annotations

from typing import Callable, Hashable

import numpy as np
import torch

from calid.runtime.kv_cache import common_prefix
from calid.runtime.seq_input import RunnerStats, SeqInput

MIN_TWIN_TOKENS = 16


def rows_of(inp: SeqInput) -> list[int]:
    return inp.logits_at if inp.logits_at is not None else [len(inp.tokens) - 1]


def find_twins(inputs: list[SeqInput], cached: Callable[[Hashable], list[int]],
               align: Callable[[int, int], int] | None = None) -> dict[int, tuple[int, int]]:
    """``{i: (j, shared)}``: input ``i`` is a twin of the earlier input ``j``: same cached ids, their first
    ``shared`` >= MIN_TWIN_TOKENS new ids equal and a plain chain in both (before any tree), and every row
    ``i`` asks for among those is one ``j`` asks for too. ``align(past, shared)``: where a runner whose rows
    depend on how a forward groups them may cut a prefix that the two feeds go on past (llama.cpp's exact
    mode: a block boundary)."""
    leaders: dict[tuple, list[int]] = {}
    twins = {}
    chains = {i: _chain_prefix(inp) for i, inp in enumerate(inputs)  # a checked chain may answer fewer rows
              if len(inp.tokens) >= MIN_TWIN_TOKENS and inp.expect is None}
    for i, inp in enumerate(inputs):
        if chains.get(i, 0) < MIN_TWIN_TOKENS:
            continue
        past = cached(inp.seq_id)
        group = leaders.setdefault(tuple(past), [])
        for j in group:
            lead = inputs[j]
            shared = min(common_prefix(lead.tokens, inp.tokens), chains[i], chains[j])
            if align is not None and not len(lead.tokens) == len(inp.tokens) == shared:
                shared = align(len(past), shared)
            if (shared >= MIN_TWIN_TOKENS and lead.seq_id != inp.seq_id  # the same one twice: the forward's error
                    and set(r for r in rows_of(inp) if r < shared) <= set(rows_of(lead))
                    and lead.reads == inp.reads):  # the rows it takes over are what it asked for
                twins[i] = (j, shared)
                break
        else:
            group.append(i)
    return twins


def _chain_prefix(inp: SeqInput) -> int:
    """How many leading new ids of ``inp`` are a plain chain that every later id sees: all of them without a
    tree; with one (``ancestors``), the committed ids before the tree's nodes."""
    if inp.ancestors is None:
        return len(inp.tokens) if inp.positions is None else 0
    a = inp.ancestors.cpu().numpy()
    lower = np.tri(len(a), dtype=bool)
    ok = (a == lower).all(axis=1) & (a | ~lower).all(axis=0)  # row c sees just 0..c; every later row sees c
    if inp.positions is not None:
        ok &= np.asarray(inp.positions) == inp.positions[0] + np.arange(len(a))
    return len(a) if ok.all() else int(np.argmin(ok))


def forward_sharing(inputs: list[SeqInput], cached: Callable[[Hashable], list[int]],
                    forward: Callable[[list[SeqInput]], list[torch.Tensor]],
                    fork: Callable[[Hashable, Hashable, int], None], stats: RunnerStats,
                    align: Callable[[int, int], int] | None = None) -> list[torch.Tensor]:
    """``forward(inputs)`` with each twin's shared work done by its leader. ``fork(src, dst, length)`` makes
    ``dst``'s cache the first ``length`` entries of ``src``'s (creating it if need be). The shared tokens
    count as reused, not computed, in ``stats``."""
    twins = find_twins(inputs, cached, align)
    if not twins:
        return forward(inputs)
    past = {i: len(cached(inputs[i].seq_id)) for i in twins}
    lead = [i for i in range(len(inputs)) if i not in twins]
    out = dict(zip(lead, forward([inputs[i] for i in lead])))
    tails = {}
    for i, (j, shared) in twins.items():
        inp = inputs[i]
        fork(inputs[j].seq_id, inp.seq_id, past[i] + shared)
        if shared < len(inp.tokens):
            own = [r - shared for r in rows_of(inp) if r >= shared]
            tails[i] = SeqInput(inp.seq_id, inp.tokens[shared:], logits_at=own or None, reads=inp.reads, pad=inp.pad,
                                positions=None if inp.positions is None else list(inp.positions[shared:]),
                                ancestors=None if inp.ancestors is None else inp.ancestors[shared:, shared:])
        stats.recomputed_tokens = max(0, stats.recomputed_tokens - min(shared, len(inp.tokens) - 1))
        stats.reused_tokens += shared
        stats.forked_sequences += 1
    fed = dict(zip(tails, forward(list(tails.values())))) if tails else {}
    for i, (j, shared) in twins.items():
        lead_rows, rows = rows_of(inputs[j]), rows_of(inputs[i])
        mine = iter(fed.get(i, ()))
        taken = [out[j][lead_rows.index(r)] if r < shared else next(mine) for r in rows]
        out[i] = taken if isinstance(out[j], list) else torch.stack(taken)  # ids (SeqInput.reads), as they came
    return [out[i] for i in range(len(inputs))]


def twin_key(ids: list[int], uncached: int) -> tuple | None:
    """What a worker's prefill budget counts once: the ids of a prompt that ``uncached`` fed ids make
    prefill-sized (None: a decode step, which is charged to each sequence)."""
    return tuple(ids) if uncached >= MIN_TWIN_TOKENS else None
