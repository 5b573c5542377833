"""Build one rank of a TP x PP target group inside an initialised torch.distributed world.

Used by the Ray shard actors (actors/shard.py), by ``calid bench parallel``
and by the distributed tests, so all three run exactly the same model code.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch import nn

from calid.models.config import ModelConfig
from calid.models.loader import load_weights, weight_footprint
from calid.parallel.layout import Layout, ShardSpec, check_layout
from calid.parallel.pp import PipelineStage, StageLinks
from calid.parallel.tp import wrap_row_parallel
from calid.runtime.runner import ModelRunner


@dataclass
class Shard:
    spec: ShardSpec
    model: nn.Module  # a LlamaModel, or a PipelineStage around one
    full_config: ModelConfig
    weight_bytes: int  # parameters this rank holds

    def runner(self, kv_budget_bytes: int | None = None) -> ModelRunner:
        return ModelRunner(self.model, kv_budget_bytes, charged_layers=self.full_config.num_layers)


def build_shard(path: Path, layout: Layout, dtype="fp32", device="cpu") -> Shard:
    """Load this rank's slice of the model in folder ``path`` and wire its communication.

    Every rank must call this (it creates one process group per stage for the
    tensor-parallel all-reduces, and group creation is collective).
    """
    cfg = ModelConfig.from_dir(path)
    check_layout(cfg, layout.tp, layout.pp)
    if dist.get_world_size() != layout.world:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks, the layout needs {layout.world}")
    rank = dist.get_rank()
    spec = layout.shard(rank)
    stage_groups = [None] * layout.pp  # None: the whole world is the tensor-parallel group
    if layout.tp > 1 and layout.pp > 1:
        stage_groups = [dist.new_group(layout.stage_ranks(s)) for s in range(layout.pp)]
    model = load_weights(path, dtype, device, shard=spec)
    weight_bytes = weight_footprint(model)[0]
    if layout.tp > 1:
        wrap_row_parallel(model, stage_groups[spec.stage])
    if layout.pp > 1:
        model = PipelineStage(model, StageLinks.of(layout, rank), layout.micro_batches or layout.pp)
    return Shard(spec, model, cfg, weight_bytes)
