"""ModelRunner: one model, its KV caches, and batched forwards over sequences.

Callers speak in token ids. ``sync(seq_id, token_ids)`` matches the ids against
the sequence's cache, rolls the cache back to the longest common prefix, and
returns the ids that still have to be fed; ``forward`` feeds them for many
sequences at once and returns the logits the caller asked for.
"""
from __future__ import annotations

import time
from typing import Hashable

import torch

from calid.models.invariant import use_invariant_linears
from calid.models.llama import LlamaModel
from calid.runtime.batch import Batch, SeqSlice, device_longs, tree_mask
from calid.runtime.graphs import DEFAULT_BATCH_SIZES, DecodeGraphs
from calid.runtime.invariant_attention import InvariantAttention
from calid.runtime.kv_cache import KVCache, KVCacheStore
from calid.runtime.paged import DEFAULT_BLOCK_SIZE, BlockPool, PagedKVCache
from calid.runtime.seq_input import RunnerStats, SeqInput  # noqa: F401 - where callers import them from
from calid.runtime.twins import forward_sharing

KV_LAYOUTS = ("paged", "contiguous")
DEFAULT_KV_LAYOUT = "paged"  # measured with ``calid bench step``: on a 2-core CPU 1.11x at batch 16-32, 0.99-1.00x at 1
GRAPH_MODES = ("off", "cuda", "static")


class ModelRunner:
    """``charged_layers``: a pipeline stage's runner charges its KV budget as if it held this many layers
    (the whole model's), so that every stage evicts the same sequences at the same time.

    ``kv_layout``: ``paged`` (one block pool, one batched attention call per layer; the default on every
    device: per-sequence kernels would set a GPU's step time) or ``contiguous`` (a buffer per sequence,
    attention per sequence: the runtime before the pool, kept as the reference ``calid bench step`` compares).

    ``graphs``: ``cuda`` replays decode steps (one token per sequence, up to ``graph_batch_sizes[-1]``
    sequences) from captured CUDA graphs (:mod:`calid.runtime.graphs`); ``static`` runs the same padded static
    step without capture (any device: the reference the graphs replay); ``off`` (default) neither.

    ``invariant``: batch-invariant forwards (calid.models.invariant, calid.runtime.invariant_attention): a
    sequence's logits depend only on its own tokens, never on what else shares the forward nor on how many of
    its tokens the forward feeds (decode, verification, tree, prefill chunk), in every dtype. The model's
    linears are converted in place."""

    max_sequences: int | None = None  # sequences one forward may hold (requests and tree branches): unbounded

    def __init__(self, model: LlamaModel, kv_budget_bytes: int | None = None, charged_layers: int | None = None,
                 kv_layout: str = DEFAULT_KV_LAYOUT, block_size: int = DEFAULT_BLOCK_SIZE, graphs: str = "off",
                 graph_batch_sizes=DEFAULT_BATCH_SIZES, invariant: bool = False):
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, not {kv_layout!r}")
        if graphs not in GRAPH_MODES:
            raise ValueError(f"graphs must be one of {', '.join(GRAPH_MODES)}, not {graphs!r}")
        if graphs != "off" and kv_layout != "paged":
            raise ValueError("decode graphs read the paged KV cache: use kv_layout='paged'")
        if invariant and (kv_layout != "paged" or graphs != "off"):
            raise ValueError("batch-invariant forwards need kv_layout='paged' and graphs='off'")
        if invariant:
            use_invariant_linears(model)
        self.invariant = invariant
        self.model = model
        cfg = model.cfg
        self.kv_layout = kv_layout
        self.graphs = None
        if self.kv_layout == "paged":
            pool = BlockPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype, model.device, block_size)
            factory = lambda: PagedKVCache(pool, charged_layers)  # noqa: E731
            if graphs != "off":
                self.graphs = DecodeGraphs(model, pool, graph_batch_sizes, capture=graphs == "cuda")
        else:
            factory = lambda: KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype,  # noqa: E731
                                      model.device, charged_layers=charged_layers)
        self.caches = KVCacheStore(factory, kv_budget_bytes)
        self.stats = RunnerStats()

    backend = "torch"

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    @property
    def max_position(self) -> int:
        return self.model.cfg.max_position

    @property
    def device(self) -> torch.device:
        return self.model.device

    def cached_count(self) -> int:
        """Sequences with a live KV cache."""
        return len(self.caches)

    def describe(self) -> str:
        graphs = ", CUDA graphs" if self.graphs is not None and self.graphs.capture else ""
        return (
            f"torch {str(self.model.dtype).removeprefix('torch.')} on {self.model.device}, {self.kv_layout} KV{graphs}"
        )

    def cached_length(self, seq_id: Hashable) -> int:
        return len(self.caches.get(seq_id)) if seq_id in self.caches else 0

    def cached_prefix(self, seq_id: Hashable, token_ids: list[int]) -> int:
        """How many leading ``token_ids`` the cache already holds (no change to the cache)."""
        return self.caches.get(seq_id).common_prefix(token_ids) if seq_id in self.caches else 0

    def sync(self, seq_id: Hashable, token_ids: list[int], keep_at_most: int | None = None) -> list[int]:
        """Roll the cache back to its longest common prefix with ``token_ids``; return the rest.

        At least one token is always returned, so a forward yields the logits
        after the last id even when everything was cached. ``keep_at_most``
        caps the reused prefix, so that the ids after it are fed (and their
        logits available) again: verification needs the row before the first
        draft token.
        """
        cache = self.caches.get(seq_id)
        cap = len(token_ids) - 1 if keep_at_most is None else min(keep_at_most, len(token_ids) - 1)
        keep = min(cache.common_prefix(token_ids), cap)
        if keep < len(cache):
            cache.truncate(keep)
        self.stats.recomputed_tokens += max(0, len(token_ids) - 1 - keep)
        return token_ids[keep:]

    def truncate(self, seq_id: Hashable, length: int) -> None:
        if seq_id in self.caches:
            self.caches.get(seq_id).truncate(length)

    @torch.inference_mode()
    def compact(self, seq_id: Hashable, rows: list[int], start: int) -> None:
        """After a tree forward: keep only cache rows ``rows`` (the accepted branch) after ``start``."""
        self.caches.get(seq_id).keep(rows, start)

    def release(self, seq_id: Hashable) -> None:
        self.caches.drop(seq_id)

    def _fork(self, src: Hashable, dst: Hashable, length: int) -> None:
        """Make ``dst``'s cache the first ``length`` entries of ``src``'s (a twin's prefill, calid.runtime.twins)."""
        cache = self.caches.get(dst)
        cache.copy_from(self.caches.get(src))
        cache.truncate(length)

    def forward(self, inputs: list[SeqInput]) -> list[torch.Tensor]:
        """Feed each sequence's new tokens; return logits [len(logits_at), vocab] per sequence. Sequences that
        repeat another's prefill exactly (the n choices of a prompt) are fed once and forked."""
        return forward_sharing(inputs, lambda seq_id: self.caches.get(seq_id).tokens, self._forward, self._fork,
                               self.stats)

    @torch.inference_mode()
    def _forward(self, inputs: list[SeqInput]) -> list[torch.Tensor]:
        seqs, ids, positions, logits_index = self._slices(inputs)
        start = time.perf_counter()
        if self.graphs is not None and len(logits_index) == len(seqs) and self.graphs.fits(seqs):
            logits = self.graphs.run(seqs, ids, positions)
        else:
            logits = self.model(self._batch(seqs, ids, positions, logits_index))
        self.stats.forward_s += time.perf_counter() - start
        for inp, s in zip(inputs, seqs):
            s.cache.commit(inp.tokens)
        self.caches.enforce_budget(pinned=set())
        self.stats.forwards += 1
        self.stats.tokens += len(ids)
        out, row = [], 0
        for inp in inputs:
            n = len(inp.logits_at) if inp.logits_at is not None else 1
            out.append(logits[row : row + n])
            row += n
        return out

    def _build_batch(self, inputs: list[SeqInput]) -> Batch:
        return self._batch(*self._slices(inputs))

    def _slices(self, inputs: list[SeqInput]) -> tuple[list[SeqSlice], list[int], list[int], list[int]]:
        """Reserve room in each sequence's cache; (slices, new ids, positions, logits rows), on the host."""
        ids, positions, logits_index, seqs = [], [], [], []
        pinned = {inp.seq_id for inp in inputs}
        if len(pinned) != len(inputs):
            raise ValueError("a sequence appears twice in one forward")
        start = 0
        for inp in inputs:
            if not inp.tokens:
                raise ValueError(f"sequence {inp.seq_id!r} has no new tokens")
            cache = self.caches.get(inp.seq_id)
            past, q = len(cache), len(inp.tokens)
            cache.reserve(q)
            ids.extend(inp.tokens)
            positions.extend(inp.positions if inp.positions is not None else range(past, past + q))
            at = inp.logits_at if inp.logits_at is not None else [q - 1]
            logits_index.extend(start + i for i in at)
            mask = (
                tree_mask(inp.ancestors.to(self.device, non_blocking=True), past) if inp.ancestors is not None else None
            )
            seqs.append(SeqSlice(start, q, past, cache, mask))
            start += q
        self.caches.enforce_budget(pinned)
        return seqs, ids, positions, logits_index

    def _batch(self, seqs: list[SeqSlice], ids: list[int], positions: list[int], logits_index: list[int]) -> Batch:
        device = self.model.device
        return Batch(
            input_ids=device_longs(ids, device),
            positions=device_longs(positions, device),
            seqs=seqs,
            logits_index=device_longs(logits_index, device),
            max_position=max(positions),
            attention=InvariantAttention(seqs) if self.invariant else None,
        )
