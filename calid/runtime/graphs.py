"""Decode steps replayed from CUDA graphs: one graph per (batch bucket, key-length bucket).

A decode step (every sequence feeds one token under a plain causal mask) runs
the same kernels every time for a given batch size and KV length. On a GPU,
launching them from Python (about 15 per layer, hundreds per step) can take
longer than running them; a captured graph launches them all at once.

:class:`DecodeGraphs` pads a decode step to static shapes: the batch to the
next bucket of ``batch_sizes`` and each sequence's block table to the next
power of two of blocks. Per step the host fills one small int64 buffer and
copies it to the device in one transfer; the graph reads:

* ``ids``, ``positions`` ``[Bp]``: the new token and its RoPE position;
* ``slots`` ``[Bp]``: the pool slot its K/V row goes to;
* ``table`` ``[Bp, NBp]``: block ids whose rows it attends to;
* ``lengths`` ``[Bp]``: how many of those rows are real (its past + 1).

Padding rows (a sequence bucket larger than the batch, a table longer than a
sequence) point at a scratch block of the pool that no sequence owns, so a
replay never writes into another sequence's rows, and ``lengths`` hides what
they read. A graph captures the pool's tensors: when the pool grows (new
tensors), every graph is dropped and captured again on next use.

``capture=False`` runs the very same padded static step eagerly, on any device:
it is what the graphs replay, and what the CPU tests check against the
ordinary paged forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from calid.runtime.batch import Batch, SeqSlice

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
_FIELDS = 4  # ids, positions, slots, lengths; then the table


def decode_only(seqs: list[SeqSlice]) -> bool:
    """Every sequence feeds one token under the plain causal mask."""
    return bool(seqs) and all(s.q_len == 1 and s.mask is None for s in seqs)


class StaticDecodeAttention:
    """Attention of one padded decode step, from device tensors only (capturable): write each new K/V row
    at its slot, gather each sequence's blocks, attend under a length mask."""

    def __init__(self, pool, slots: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor):
        self.pool, self.slots = pool, slots
        batch, blocks = table.shape
        kv_heads = pool.row_shape[0]
        heads = torch.arange(kv_heads, device=table.device)[:, None, None] * pool.num_blocks
        self.rows = (heads + table[None]).reshape(-1)  # [kv_heads * Bp * NBp] (head, block) rows of the pool
        self.length = blocks * pool.block_size
        keys = torch.arange(self.length, device=table.device)
        self.mask = (keys[None, :] < lengths[:, None])[:, None, None, :]  # [Bp, 1, 1, L]
        self.shape = (kv_heads, batch, self.length)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.write(layer, self.slots, k, v)
        kv_heads, batch, length = self.shape
        dim = q.shape[-1]
        keys, values = (p.view(-1, self.pool.block_size, dim).index_select(0, self.rows)
                        .view(kv_heads, batch, length, dim).transpose(0, 1)
                        for p in (self.pool.k[layer], self.pool.v[layer]))  # [Bp, KV, L, D]
        o = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=self.mask,
                                           enable_gqa=q.shape[1] != kv_heads)  # q [Bp, H, 1, D]
        return o[:, :, 0]


@dataclass
class _Step:
    """One bucket's static buffers and, when captured, its graph and output."""

    host: torch.Tensor  # [4 * Bp + Bp * NBp] int64, pinned on CUDA
    device_buf: torch.Tensor
    batch: Batch
    buffers: tuple = ()  # slots, table, lengths: views of device_buf
    graph: object | None = None  # torch.cuda.CUDAGraph
    copied: object | None = None  # torch.cuda.Event: the last copy of ``host`` to the device is done
    logits: torch.Tensor | None = None  # the graph's static output [Bp, vocab]


class DecodeGraphs:
    """Padded static decode steps for one model and block pool; CUDA graphs of them when ``capture``."""

    def __init__(self, model, pool, batch_sizes=DEFAULT_BATCH_SIZES, capture: bool = True):
        if capture and pool.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this model is on {pool.device}")
        if model.embed is None or model.lm_head is None:
            raise ValueError("decode graphs run a whole model (a pipeline stage has no embedding or head)")
        self.model, self.pool, self.capture = model, pool, capture
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.max_blocks = -(-model.cfg.max_position // pool.block_size)
        self.scratch = pool.allocate(1)[0]  # padding writes land here; no sequence owns it
        self._steps: dict[tuple[int, int], _Step] = {}
        self._pool_blocks = pool.num_blocks
        self._mempool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = self.captures = 0

    def fits(self, seqs: list[SeqSlice]) -> bool:
        return (decode_only(seqs) and len(seqs) <= self.batch_sizes[-1]
                and all(getattr(s.cache, "pool", None) is self.pool for s in seqs))

    def run(self, seqs: list[SeqSlice], ids: list[int], positions: list[int]) -> torch.Tensor:
        """Logits [B, vocab] of a decode step that ``fits``: sequence b feeds ``ids[b]`` at ``positions[b]``."""
        bs = self.pool.block_size
        if self.pool.num_blocks != self._pool_blocks:  # the pool grew: the graphs hold its old tensors
            self._steps.clear()
            self._pool_blocks = self.pool.num_blocks
        bp = next(b for b in self.batch_sizes if b >= len(seqs))
        used = max(s.past // bs + 1 for s in seqs)
        nbp = min(1 << (used - 1).bit_length(), max(self.max_blocks, used))
        step = self._steps.get((bp, nbp)) or self._build(bp, nbp)
        if step.copied is not None:
            step.copied.synchronize()  # the previous step's copy may still read the pinned buffer
        pad, scratch = bp - len(seqs), self.scratch
        table = []
        for s in seqs:
            blocks = s.cache.blocks[: s.past // bs + 1]
            table += blocks + [scratch] * (nbp - len(blocks))
        step.host.copy_(torch.tensor(
            ids + [0] * pad + positions + [0] * pad
            + [s.cache.blocks[s.past // bs] * bs + s.past % bs for s in seqs] + [scratch * bs] * pad
            + [s.past + 1 for s in seqs] + [1] * pad + table + [scratch] * (pad * nbp), device="cpu"))
        step.device_buf.copy_(step.host, non_blocking=True)
        if step.copied is not None:
            step.copied.record()
        return self._replay(step)[: len(seqs)].clone()

    def _padding(self, bp: int, nbp: int) -> torch.Tensor:
        pad = torch.zeros(_FIELDS * bp + bp * nbp, dtype=torch.long, device="cpu")
        pad[2 * bp : 3 * bp] = self.scratch * self.pool.block_size  # writes go to the scratch block
        pad[3 * bp : 4 * bp] = 1  # one key each, so a padding row's softmax is defined
        pad[_FIELDS * bp :] = self.scratch
        return pad

    def _build(self, bp: int, nbp: int) -> _Step:
        device = self.pool.device
        pad = self._padding(bp, nbp)
        host = pad.pin_memory() if device.type == "cuda" else pad
        buf = pad.to(device)
        ids, positions, slots, lengths = (buf[i * bp : (i + 1) * bp] for i in range(_FIELDS))
        table = buf[_FIELDS * bp :].view(bp, nbp)
        batch = Batch(ids, positions, [], torch.arange(bp, device=device), max_position=self.model.cfg.max_position - 1)
        step = _Step(host, buf, batch, (slots, table, lengths))
        self._steps[(bp, nbp)] = step
        if not self.capture:
            return step
        self.model.rotary.tables(self.model.cfg.max_position, self.model.dtype, device)  # no growth inside a graph
        run = lambda: self._forward(step.batch, step.buffers)  # noqa: E731
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the capture: lazy initialisation, library workspaces
            run()
        torch.cuda.current_stream(device).wait_stream(side)
        step.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(step.graph, pool=self._mempool):
            step.logits = run()
        step.copied = torch.cuda.Event()
        self.captures += 1
        return step

    def _forward(self, batch: Batch, buffers) -> torch.Tensor:
        batch.attention = StaticDecodeAttention(self.pool, *buffers)
        return self.model(batch)

    def _replay(self, step: _Step) -> torch.Tensor:
        self.replays += 1
        if step.graph is None:
            return self._forward(step.batch, step.buffers)
        step.graph.replay()
        return step.logits
