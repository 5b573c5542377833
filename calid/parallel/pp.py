"""Pipeline parallelism: one stage of the decoder, wired to its neighbours with torch.distributed.

Every rank of a group runs the same worker over the same tasks (see
actors/shard.py), so every stage builds the same ragged batch from its own KV
caches. A stage's forward cuts that batch into micro-batches of whole
sequences and, for each one, receives the hidden states from the stage before
(the first stage embeds the tokens instead), runs its layers, and sends the
result on without waiting (``isend``): while stage k+1 works on micro-batch i,
stage k already works on micro-batch i+1. The last stage turns the hidden
states into logits and broadcasts them, so every stage reaches the same
verdicts and applies the same cache edits (tree compaction, rollback).

Cost per forward: one hidden-state transfer per stage boundary and micro-batch
([tokens, hidden]), and one broadcast of the logits ([rows, vocab]).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from calid.models.llama import LlamaModel
from calid.parallel.layout import Layout
from calid.runtime.batch import Batch, split_batch


@dataclass(frozen=True)
class StageLinks:
    """Global ranks a stage talks to: ``prev`` sends it hidden states, it sends to ``next``, "
    "``last`` broadcasts logits."""

    prev: int | None
    next: int | None
    last: int

    @classmethod
    def of(cls, layout: Layout, rank: int) -> "StageLinks":
        spec = layout.shard(rank)
        peer = lambda stage: stage * layout.tp + spec.tp_rank  # noqa: E731 (same tensor-parallel rank, other stage)
        return cls(prev=None if spec.first else peer(spec.stage - 1), next=None if spec.last else peer(spec.stage + 1),
                   last=(layout.pp - 1) * layout.tp)


class PipelineStage(nn.Module):
    """Stands in for a LlamaModel in a ModelRunner: ``forward(batch)`` returns the whole model's logits."""

    def __init__(self, model: LlamaModel, links: StageLinks, micro_batches: int):
        super().__init__()
        self.model, self.links, self.micro_batches = model, links, max(1, micro_batches)
        self.cfg = model.cfg  # this stage's layers: the KV caches hold only these

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    def forward(self, batch: Batch) -> torch.Tensor:
        model, links = self.model, self.links
        sends, logits = [], []
        for mb in split_batch(batch, self.micro_batches):
            if links.prev is None:
                x = model.embed_tokens(mb)
            else:
                x = torch.empty(len(mb.input_ids), self.cfg.hidden_size, dtype=self.dtype, device=self.device)
                dist.recv(x, links.prev)
            x = model.run_layers(x, mb)
            if links.next is None:
                logits.append(model.logits(x, mb))
            else:
                sends.append((dist.isend(x, links.next), x))  # x stays referenced until the send completes
        for work, _ in sends:
            work.wait()
        if links.next is None:
            out = torch.cat(logits)
        else:
            out = torch.empty(len(batch.logits_index), self.cfg.vocab_size, dtype=self.dtype, device=self.device)
        dist.broadcast(out, links.last)
        return out
