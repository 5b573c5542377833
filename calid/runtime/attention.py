"""Attention over a ragged batch, planned once per forward and run once per layer.

``attention_for(batch)`` returns a callable ``attend(layer, q, k, v) -> out``
(q/out ``[T, heads, head_dim]``, k/v ``[T, kv_heads, head_dim]``, the batch's
new tokens flat) that stores the new keys and values in the sequences' caches
and attends each new token to its sequence's past and to the new tokens its
mask allows:

* :class:`SequenceAttention` (contiguous per-sequence caches): one SDPA call
  per sequence, on views of its own buffers, no copies;
* :class:`PagedAttention` (paged caches): one write of all new K/V into the
  pool, then one SDPA call per *group* over a padded layout ``[B, heads,
  q_max, L]``: every sequence whose new-token count is at most
  ``SHORT_QUERY`` (decode, verification, token trees) shares one group; longer
  prefill chunks group by size class (a power of two), so that padding never
  more than doubles a group's query rows. Keys are gathered by block from the
  pool (a single sequence whose blocks are consecutive reads a slice instead),
  and one boolean mask per group carries causality, tree ancestry and the
  padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from calid.runtime.batch import Batch, SeqSlice, device_longs
from calid.runtime.paged import PagedKVCache

SHORT_QUERY = 16  # new tokens per sequence up to which sequences share the batch's main attention group


def attention_for(batch: Batch):
    seqs = batch.seqs
    if seqs and isinstance(seqs[0].cache, PagedKVCache):
        return PagedAttention(seqs)
    return SequenceAttention(seqs)


def _sdpa(q, k, v, mask, causal: bool):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]
    )


class SequenceAttention:
    def __init__(self, seqs: list[SeqSlice]):
        self.seqs = seqs

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        for s in self.seqs:
            s.cache.write(layer, s.past, k[s.start : s.end].transpose(0, 1), v[s.start : s.end].transpose(0, 1))
            keys, values = s.cache.view(layer, s.past + s.q_len)
            o = _sdpa(q[s.start : s.end].transpose(0, 1).unsqueeze(0),  # [1, H, q, D]
                      keys.unsqueeze(0), values.unsqueeze(0),  # [1, KV, past+q, D]
                      s.attn_mask(), s.is_causal_from_zero and s.q_len > 1)
            out[s.start : s.end] = o[0].transpose(0, 1)
        return out


@dataclass
class _Group:
    """One SDPA call: ``size`` sequences, ``q_max`` query rows and ``length`` key rows each (padded)."""

    size: int
    q_max: int
    length: int
    mask: torch.Tensor | None  # [size, 1, q_max, length] bool; None where plain (causal from 0 / one query)
    causal: bool
    blocks: torch.Tensor | None  # [kv_heads * size * blocks_each] (head, block) rows to gather; None: a slice
    first_block: int
    rows: torch.Tensor | None  # [size * q_max] flat rows of q in padded order; None: the whole batch, one row each
    picks: torch.Tensor | None  # [n] rows of the padded output that are real tokens, in flat order of ``tokens``
    tokens: torch.Tensor | None  # [n] their flat rows
    # the keys' and values' gather buffers, reused by every layer. Allocated anew per layer (2 x 6.7 MB per
    # layer at batch 32, context 256 on SmolLM2), the paged step ran at 0.65-0.68x the contiguous one in 3 of
    # 5 runs of ``calid bench step`` on a 2-core AVX2 EPYC; with one pair per forward, 1.08-1.23x in 3 of 3
    gathered: list[torch.Tensor] | None = None


class PagedAttention:
    def __init__(self, seqs: list[SeqSlice]):
        pool = seqs[0].cache.pool
        self.pool, self.device = pool, pool.device
        slots = [slot for s in seqs for slot in s.cache.slots(s.past, s.q_len)]
        self.slots = device_longs(slots, self.device)
        total = seqs[-1].end
        classes: dict[int, list[SeqSlice]] = {}
        for s in seqs:
            size_class = 0 if s.q_len <= SHORT_QUERY else (s.q_len - 1).bit_length()
            classes.setdefault(size_class, []).append(s)
        self.groups = [self._plan(group, whole=len(group) == len(seqs), total=total) for group in classes.values()]

    def _plan(self, seqs: list[SeqSlice], whole: bool, total: int) -> _Group:
        bs, device = self.pool.block_size, self.device
        q_max = max(s.q_len for s in seqs)
        in_order = whole and (q_max == 1 or len(seqs) == 1)  # q, flat, is already [size, q_max]
        rows = picks = tokens = None
        if not in_order:
            rows, picks, tokens = [], [], []
            for b, s in enumerate(seqs):
                rows.extend(range(s.start, s.end))
                rows.extend([s.start] * (q_max - s.q_len))  # padding rows repeat a real one; their output is dropped
                picks.extend(range(b * q_max, b * q_max + s.q_len))
                tokens.extend(range(s.start, s.end))
            rows, picks, tokens = (device_longs(x, device) for x in (rows, picks, tokens))
        if len(seqs) == 1 and seqs[0].cache.consecutive:
            s = seqs[0]
            mask = s.attn_mask()
            return _Group(1, q_max, s.past + s.q_len, None if mask is None else mask[None, None],
                          s.is_causal_from_zero and s.q_len > 1, None, s.cache.blocks[0], rows, picks, tokens)
        each = max(-(-(s.past + s.q_len) // bs) for s in seqs)
        table = []  # block 0 pads: it always exists, and the mask hides it
        for s in seqs:
            used = -(-(s.past + s.q_len) // bs)
            table.extend(s.cache.blocks[:used] + [0] * (each - used))
        per_head = [h * self.pool.num_blocks + b for h in range(self.pool.row_shape[0]) for b in table]
        return _Group(len(seqs), q_max, each * bs, _padded_mask(seqs, q_max, each * bs, device), False,
                      device_longs(per_head, device), 0, rows, picks, tokens)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.write(layer, self.slots, k, v)
        T, H, D = q.shape
        pool_k, pool_v = self.pool.k[layer], self.pool.v[layer]  # [KV, blocks, block_size, D]
        out = None if len(self.groups) == 1 and self.groups[0].rows is None else torch.empty_like(q)
        for g in self.groups:
            if g.blocks is None:
                nb = -(-g.length // self.pool.block_size)
                keys, values = (p[:, g.first_block : g.first_block + nb].flatten(1, 2)[:, : g.length].unsqueeze(0)
                                for p in (pool_k, pool_v))  # [1, KV, L, D]
            else:  # a dim-0 gather (whole 4 KB rows) runs ~5x faster on CPU than one along the block dim
                kv_heads = pool_k.shape[0]
                if g.gathered is None:  # one pair of buffers for every layer (see _Group.gathered)
                    g.gathered = [pool_k.new_empty(len(g.blocks), self.pool.block_size, D) for _ in range(2)]
                grad = torch.is_grad_enabled()  # out= refuses autograd (the model outside inference mode)
                keys, values = (torch.index_select(p.view(-1, self.pool.block_size, D), 0, g.blocks,
                                                   **({} if grad else {"out": buf}))
                                .view(kv_heads, g.size, g.length, D).transpose(0, 1)
                                for p, buf in zip((pool_k, pool_v), g.gathered))  # [B, KV, L, D]
            qg = (q if g.rows is None else q.index_select(0, g.rows)).view(g.size, g.q_max, H, D)
            o = _sdpa(qg.transpose(1, 2), keys, values, g.mask, g.causal)
            o = o.transpose(1, 2).reshape(g.size * g.q_max, H, D)
            if out is None:
                return o
            out.index_copy_(0, g.tokens, o.index_select(0, g.picks))
        return out


def _padded_mask(seqs: list[SeqSlice], q_max: int, length: int, device) -> torch.Tensor:
    """[B, 1, q_max, length] bool: new token i of sequence b sees rows <= past_b + i (its own tree mask
    where it has one); padding rows see what the sequence's last token sees; rows past a sequence's end
    are hidden."""
    past = device_longs([s.past for s in seqs], device)
    q_len = device_longs([s.q_len for s in seqs], device)
    i = torch.arange(q_max, device=device)
    last_seen = past[:, None] + torch.minimum(i[None, :], q_len[:, None] - 1)  # [B, q_max]
    mask = torch.arange(length, device=device)[None, None, :] <= last_seen[:, :, None]
    for b, s in enumerate(seqs):
        if s.mask is not None:  # already on the device (the runner puts it there)
            mask[b, : s.q_len, : s.past + s.q_len] = s.mask
    return mask.unsqueeze(1)
