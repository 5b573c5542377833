"""A ragged batch: the new tokens of several sequences flattened into one forward.

Linear layers run once over all T new tokens (one read of the weights for the
whole batch); attention runs per sequence against that sequence's KV cache,
under that sequence's mask. Terms:

* ``past``     tokens already in a sequence's KV cache;
* ``q_len``    new tokens of that sequence in this forward;
* ``mask``     bool [q_len, past + q_len], True where a new token may attend;
               None means plain causal (the common case, built lazily);
* ``positions`` RoPE positions of the new tokens (a token tree repeats depths).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from calid.runtime.kv_cache import KVCache


@dataclass
class SeqSlice:
    start: int  # offset of this sequence's first new token in the flat batch
    q_len: int
    past: int
    cache: KVCache
    mask: torch.Tensor | None  # [q_len, past + q_len] bool, or None for causal

    @property
    def end(self) -> int:
        return self.start + self.q_len

    @property
    def is_causal_from_zero(self) -> bool:
        return self.mask is None and self.past == 0

    def attn_mask(self) -> torch.Tensor | None:
        """Mask for SDPA; None where SDPA needs none (single query, or causal from 0)."""
        if self.mask is not None:
            return self.mask
        if self.q_len == 1 or self.past == 0:
            return None
        return causal_mask(self.q_len, self.past, self.cache.device)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    seqs: list[SeqSlice]
    logits_index: torch.Tensor  # [L] long, rows of the flat batch whose logits are wanted
    max_position: int | None = None  # largest of ``positions``, known on the host (no device sync to read it)
    attention: object | None = None  # a prepared ``attend(layer, q, k, v)`` (decode graphs); None: planned per forward


def device_longs(values, device) -> torch.Tensor:
    """Host ints as a long tensor on ``device``, without a device sync: a blocking host-to-device copy waits
    for all queued GPU work, while one from pageable memory with ``non_blocking`` is staged at once."""
    return torch.tensor(values, dtype=torch.long, device="cpu").to(device, non_blocking=True)


def causal_mask(q_len: int, past: int, device) -> torch.Tensor:
    """[q_len, past + q_len] bool: new token i sees the past and new tokens 0..i."""
    return torch.ones(q_len, past + q_len, dtype=torch.bool, device=device).tril(diagonal=past)


def tree_mask(ancestors: torch.Tensor, past: int) -> torch.Tensor:
    """Extend a [q, q] ancestor mask (True = may attend) with full access to the past."""
    q = ancestors.shape[0]
    full = torch.ones(q, past + q, dtype=torch.bool, device=ancestors.device)
    full[:, past:] = ancestors
    return full


def split_batch(batch: Batch, parts: int) -> list[Batch]:
    """Cut ``batch`` into at most ``parts`` micro-batches of whole sequences, balanced by new tokens.

    Each micro-batch is a Batch of its own (offsets rebased); its logits rows
    are its share of ``batch.logits_index``, in order, so concatenating the
    micro-batches' logits gives the batch's.
    """
    seqs = batch.seqs
    parts = max(1, min(parts, len(seqs)))
    if parts == 1:
        return [batch]
    total = seqs[-1].end
    groups: list[list[SeqSlice]] = [[]]
    for i, s in enumerate(seqs):
        left_seqs, left_groups = len(seqs) - i, parts - len(groups)
        past_cut = s.start + s.q_len / 2 >= total * len(groups) / parts  # most of s lies beyond this group's share
        full = groups[-1] and (past_cut or left_seqs <= left_groups)
        if full and left_groups > 0:
            groups.append([])
        groups[-1].append(s)
    out = []
    for group in groups:
        lo, hi = group[0].start, group[-1].end
        rows = (batch.logits_index >= lo) & (batch.logits_index < hi)
        out.append(Batch(
            input_ids=batch.input_ids[lo:hi],
            positions=batch.positions[lo:hi],
            seqs=[SeqSlice(s.start - lo, s.q_len, s.past, s.cache, s.mask) for s in group],
            logits_index=batch.logits_index[rows] - lo,
            max_position=batch.max_position,
        ))
    return out
