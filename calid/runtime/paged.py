"""A paged KV cache: blocks of ``block_size`` token rows from one pool, a block table per sequence.

:class:`BlockPool` holds every layer's keys and values for all sequences of a
runner as ``[num_kv_heads, num_blocks, block_size, head_dim]``; a token's
*slot* is ``block * block_size + offset``. Heads outermost, as in a contiguous
per-sequence cache: attention reads each head's keys as dense rows (a slice of
the pool for consecutive blocks, a block gather otherwise); with tokens
outermost the same read is strided and the attention kernel ran at half speed
on CPU at 4k context. :class:`PagedKVCache` is one
sequence's block table and token ids, with the interface of
:class:`~calid.runtime.kv_cache.KVCache`: rollback and eviction are block-table
edits (the blocks past the new end go back to the pool at once), tree
compaction copies only the accepted rows. Attention over many sequences reads
the pool through their block tables in one call per layer
(:mod:`calid.runtime.attention`).
"""
from __future__ import annotations

import heapq

import torch

from calid.runtime.batch import device_longs
from calid.runtime.kv_cache import common_prefix

DEFAULT_BLOCK_SIZE = 16


class BlockPool:
    """K/V storage shared by the sequences of one runner; grows by doubling when its free list runs out."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype, device,
                 block_size: int = DEFAULT_BLOCK_SIZE, blocks: int = 64):
        if block_size < 1 or blocks < 1:
            raise ValueError("block_size and blocks must be >= 1")
        self.num_layers, self.block_size = num_layers, block_size
        self.row_shape = (num_kv_heads, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.num_blocks = 0
        self._free: list[int] = []
        self._grow(blocks)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def block_bytes(self, layers: int | None = None) -> int:
        """Bytes of one block's keys and values over ``layers`` layers (default: this pool's)."""
        heads, dim = self.row_shape
        per_layer = self.block_size * heads * dim * torch.finfo(self.dtype).bits // 8
        return 2 * (layers or self.num_layers) * per_layer

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            self._grow(max(2 * self.num_blocks, self.num_blocks + n))
        # the lowest ids first, so that a growing sequence tends to get consecutive blocks
        return [heapq.heappop(self._free) for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            heapq.heappush(self._free, b)

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values by slot: ``[kv_heads, num_blocks * block_size, head_dim]`` views."""
        return self.k[layer].flatten(1, 2), self.v[layer].flatten(1, 2)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ``[n, kv_heads, head_dim]`` at ``slots`` [n] of ``layer``."""
        fk, fv = self.flat(layer)
        fk.index_copy_(1, slots, k.transpose(0, 1))
        fv.index_copy_(1, slots, v.transpose(0, 1))

    def move(self, src: list[int], dst: list[int]) -> None:
        """Copy the rows at slots ``src`` to slots ``dst``, in every layer."""
        src_t, dst_t = device_longs(src, self.device), device_longs(dst, self.device)
        for layer in range(self.num_layers):
            for store in self.flat(layer):
                store.index_copy_(1, dst_t, store.index_select(1, src_t))

    def _grow(self, blocks: int) -> None:
        heads, dim = self.row_shape
        shape = (heads, blocks, self.block_size, dim)
        for store in (self.k, self.v):
            for layer in range(self.num_layers):
                # zeros, not empty: attention reads padding rows under a mask, and a weight of 0 times a stray
                # NaN bit pattern is still NaN
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if layer < len(store):
                    new[:, : self.num_blocks] = store[layer]
                    store[layer] = new
                else:
                    store.append(new)
        self.free(list(range(self.num_blocks, blocks)))
        self.num_blocks = blocks


class PagedKVCache:
    """One sequence's block table in a :class:`BlockPool`, and the token ids whose K/V it holds."""

    def __init__(self, pool: BlockPool, charged_layers: int | None = None):
        self.pool = pool
        self.device = pool.device
        self.num_layers, self.shape = pool.num_layers, pool.row_shape
        self.charged_layers = charged_layers or pool.num_layers
        self.blocks: list[int] = []
        self.tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_size

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.pool.block_bytes()

    @property
    def charged_bytes(self) -> int:
        return len(self.blocks) * self.pool.block_bytes(self.charged_layers)

    @property
    def consecutive(self) -> bool:
        """Whether the block table is one run of consecutive blocks (then its rows are one slice of the pool)."""
        b = self.blocks
        return not b or b[-1] - b[0] == len(b) - 1 and all(y == x + 1 for x, y in zip(b, b[1:]))

    def reserve(self, n_new: int) -> None:
        need = -(-(len(self.tokens) + n_new) // self.pool.block_size)
        if need > len(self.blocks):
            self.blocks.extend(self.pool.allocate(need - len(self.blocks)))

    def slots(self, start: int, n: int) -> list[int]:
        """Pool slots of rows start..start+n (reserved)."""
        return self.slots_of(range(start, start + n))

    def commit(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def truncate(self, length: int) -> None:
        """Forget everything after the first ``length`` tokens; blocks past them return to the pool."""
        del self.tokens[length:]
        keep = -(-length // self.pool.block_size)
        if keep < len(self.blocks):
            self.pool.free(self.blocks[keep:])
            del self.blocks[keep:]

    def keep(self, rows: list[int], start: int) -> None:
        """Keep only rows ``rows`` (absolute, increasing, >= start) after ``start``, packed (tree compaction)."""
        if rows != list(range(start, start + len(rows))):
            self.pool.move(self.slots_of(rows), self.slots(start, len(rows)))
            self.tokens = self.tokens[:start] + [self.tokens[r] for r in rows]
        self.truncate(start + len(rows))

    def slots_of(self, rows) -> list[int]:
        bs, blocks = self.pool.block_size, self.blocks
        return [blocks[r // bs] * bs + r % bs for r in rows]

    def common_prefix(self, token_ids: list[int]) -> int:
        return common_prefix(self.tokens, token_ids)

    def copy_from(self, other: PagedKVCache) -> None:
        """Hold what ``other`` holds (a fork), in blocks of its own."""
        n = len(other)
        self.truncate(0)
        self.reserve(n)
        if n:
            self.pool.move(other.slots(0, n), self.slots(0, n))
        self.tokens = list(other.tokens)

    def release(self) -> None:
        """Give every block back to the pool (the cache is empty afterwards)."""
        self.truncate(0)
