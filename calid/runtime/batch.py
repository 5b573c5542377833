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


def causal_mask(q_len: int, past: int, device) -> torch.Tensor:
    """[q_len, past + q_len] bool: new token i sees the past and new tokens 0..i."""
    return torch.ones(q_len, past + q_len, dtype=torch.bool, device=device).tril(diagonal=past)


def tree_mask(ancestors: torch.Tensor, past: int) -> torch.Tensor:
    """Extend a [q, q] ancestor mask (True = may attend) with full access to the past."""
    q = ancestors.shape[0]
    full = torch.ones(q, past + q, dtype=torch.bool, device=ancestors.device)
    full[:, past:] = ancestors
    return full
