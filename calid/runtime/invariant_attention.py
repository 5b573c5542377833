"""Batch-invariant attention over a paged KV cache: a query row's output depends only on its own query and the
keys and values it may see, never on which forward computed it (a decode step, a verification of k drafts, a
token tree, a prefill chunk) nor on what else shares that forward.

SDPA cannot promise that: its kernels split the key axis by the key count and round a padded, masked row
differently from the same row alone (measured on this project's CPUs: 38 of 45 padded fp32 cases, 8 of 45
bf16 ones). Here every query row is computed in its *canonical layout*, the keys in position order, exactly
what a one-token decode step of that token would see, and every reduction has a fixed shape:

    units        each sequence's new tokens in blocks of QUERY_BLOCK rows (a tree node: a unit of its own,
                 its keys gathered as the chain from the root to it, so it sees what decode would)
    scores       per (unit, kv head, key block of KEY_BLOCK keys): one GEMM [QUERY_BLOCK * g, D] x [D, KEY_BLOCK]
    softmax      max over the visible keys (exact in any order), exp; the denominator is the sum of each key
                 block (a reduction of fixed length) added block after block in position order (a cumsum)
    values       per block one GEMM [QUERY_BLOCK * g, KEY_BLOCK] x [KEY_BLOCK, D], added block after block

A key block a row cannot see contributes exact zeros, and blocks after its last visible one add +0.0, so the
number of blocks a forward pads to never changes a row's bits. Shapes of every GEMM are constants of the
model (g = query heads per kv head), so the BLAS picks the same kernel for every forward.
"""
from __future__ import annotations

import torch

from calid.runtime.batch import SeqSlice, device_longs

QUERY_BLOCK = 8
KEY_BLOCK = 64


class InvariantAttention:
    """``attend(layer, q, k, v)`` for one forward over sequences in one paged pool (see the module doc)."""

    def __init__(self, seqs: list[SeqSlice]):
        self.pool = seqs[0].cache.pool
        device = self.device = self.pool.device
        self.slots = device_longs([x for s in seqs for x in s.cache.slots(s.past, s.q_len)], device)
        units = []  # (flat query rows, key slots, last visible key index of each query row)
        for s in seqs:
            if s.mask is None:  # a chain: row i sees keys 0 .. past + i
                for a in range(0, s.q_len, QUERY_BLOCK):
                    b = min(s.q_len, a + QUERY_BLOCK)
                    units.append((list(range(s.start + a, s.start + b)), s.cache.slots(0, s.past + b),
                                  [s.past + i for i in range(a, b)]))
            else:  # a token tree: each node sees the past and its ancestors, in position order
                mask = s.mask.cpu()
                for i in range(s.q_len):
                    rows = mask[i].nonzero().flatten().tolist()
                    units.append(([s.start + i], s.cache.slots_of(rows), [len(rows) - 1]))
        blocks = max(-(-len(keys) // KEY_BLOCK) for _, keys, _ in units)
        width = blocks * KEY_BLOCK
        q_rows, key_slots, last = [], [], []
        for rows, keys, seen in units:
            q_rows += rows + [rows[0]] * (QUERY_BLOCK - len(rows))  # padding rows: outputs dropped
            key_slots += keys + [keys[0]] * (width - len(keys))  # padding keys: never visible
            last += seen + [0] * (QUERY_BLOCK - len(seen))  # a padding row sees key 0 only (no empty softmax)
        self.units, self.blocks = len(units), blocks
        self.q_rows = device_longs(q_rows, device)
        self.key_slots = device_longs(key_slots, device)
        self.out_rows = device_longs([r for rows, _, _ in units for r in rows], device)
        self.out_picks = device_longs([u * QUERY_BLOCK + j for u, (rows, _, _) in enumerate(units)
                                       for j in range(len(rows))], device)
        pos = torch.arange(width, device=device)
        self.visible = pos[None, None, :] <= device_longs(last, device).view(
            self.units, QUERY_BLOCK, 1
        )  # [U, QB, width]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.write(layer, self.slots, k, v)
        _, heads, dim = q.shape
        kv_heads = k.shape[1]
        g, units, nb, qb = heads // kv_heads, self.units, self.blocks, QUERY_BLOCK
        fk, fv = self.pool.flat(layer)  # [KV, slots, D]
        # [U, KV, NB, KEY_BLOCK, D] (padding keys repeat a real one: finite, and never visible)
        keys, values = (f.index_select(1, self.key_slots).view(kv_heads, units, nb, KEY_BLOCK, dim).transpose(0, 1)
                        for f in (fk, fv))
        # queries [U, KV, QB * g, D], repeated for every key block: [U * KV * NB, QB * g, D]
        qu = q.index_select(0, self.q_rows).view(units, qb, kv_heads, g, dim).permute(0, 2, 1, 3, 4)
        qu = qu.reshape(units, kv_heads, 1, qb * g, dim).expand(units, kv_heads, nb, qb * g, dim)
        scores = torch.bmm(qu.reshape(-1, qb * g, dim), keys.reshape(-1, KEY_BLOCK, dim).transpose(1, 2))
        s = scores.float().view(units, kv_heads, nb, qb, g, KEY_BLOCK) * dim ** -0.5
        seen = self.visible.view(units, 1, qb, nb, 1, KEY_BLOCK).transpose(2, 3)  # [U, 1, NB, QB, 1, KB]
        s = s.masked_fill(~seen, float("-inf"))
        e = (s - s.amax(dim=(2, 5), keepdim=True)).exp()  # [U, KV, NB, QB, g, KB]
        denom = e.sum(-1).movedim(2, -1).cumsum(-1)[..., -1]  # [U, KV, QB, g]
        pv = torch.bmm(e.view(-1, qb * g, KEY_BLOCK), values.float().reshape(-1, KEY_BLOCK, dim))
        num = pv.view(units, kv_heads, nb, qb, g, dim).movedim(2, -1).cumsum(-1)[..., -1]  # [U, KV, QB, g, D]
        o = (num / denom[..., None]).permute(0, 2, 1, 3, 4).reshape(units * qb, heads, dim).to(q.dtype)
        out = torch.empty_like(q)
        out.index_copy_(0, self.out_rows, o.index_select(0, self.out_picks))
        return out
