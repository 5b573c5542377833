"""Tensor parallelism applied to a loaded LlamaModel, in place.

Megatron-style split over ``world`` ranks of one process group:
  column-parallel  q|k|v (by heads; GQA splits query and KV heads alike) and gate|up
                   (by intermediate rows): each rank computes its slice, no communication;
  row-parallel     o and down (by input columns): each rank produces a partial sum,
                   and one all-reduce per projection restores the full output.
Embedding, norms and the head stay replicated, so every rank ends with the same
logits. The model's config is replaced by the shard's (local heads, local
intermediate size), so KV caches built from it hold only the local KV heads.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from calid.models.llama import LlamaModel
from calid.parallel.layout import ParallelConfigError, ShardSpec, check_layout, tp_range

__all__ = ["AllReduce", "ParallelConfigError", "apply_tensor_parallel", "check_tensor_parallel", "wrap_row_parallel"]


def check_tensor_parallel(cfg, tp: int) -> None:
    check_layout(cfg, tp=tp)


class AllReduce(nn.Module):
    """A row-parallel projection: the local partial product, summed over the group."""

    def __init__(self, linear: nn.Module, group=None):
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        dist.all_reduce(out, group=self.group)
        return out


def wrap_row_parallel(model: LlamaModel, group=None) -> LlamaModel:
    """Sum the partial outputs of every o and down projection over ``group`` (a sliced model's only communication)."""
    for block in model.layers:
        block.attn.wo = AllReduce(block.attn.wo, group)
        block.mlp.w_down = AllReduce(block.mlp.w_down, group)
    return model


def _keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    linear.out_features = len(rows)


def _keep_columns(linear: nn.Linear, start: int, end: int) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[:, start:end].clone(), requires_grad=False)
    linear.in_features = end - start


def _fused_rows(sizes: list[int], rank: int, world: int) -> torch.Tensor:
    """Rows of a fused projection (parts of ``sizes`` stacked) that rank ``rank`` keeps: its share of each part."""
    rows, offset = [], 0
    for n in sizes:
        start, end = tp_range(n, rank, world)
        rows.append(torch.arange(offset + start, offset + end))
        offset += n
    return torch.cat(rows)


def apply_tensor_parallel(model: LlamaModel, rank: int, world: int, group=None) -> LlamaModel:
    """Turn a whole loaded ``model`` into shard ``rank`` of ``world`` (in place; returns it).

    The same slices as ``load_model(..., shard=...)`` reads from the checkpoint
    directly; this form is for a model already in memory.
    """
    cfg = model.cfg
    check_tensor_parallel(cfg, world)
    if world == 1:
        return model
    local = ShardSpec(rank, world).local_config(cfg)
    qkv_rows = _fused_rows([cfg.q_size, cfg.kv_size, cfg.kv_size], rank, world)
    gate_up_rows = _fused_rows([cfg.intermediate_size] * 2, rank, world)
    for block in model.layers:
        attn, mlp = block.attn, block.mlp
        _keep_rows(attn.wqkv, qkv_rows)
        _keep_columns(attn.wo, *tp_range(cfg.q_size, rank, world))
        attn.num_heads, attn.num_kv_heads = local.num_heads, local.num_kv_heads
        _keep_rows(mlp.w_gate_up, gate_up_rows)
        _keep_columns(mlp.w_down, *tp_range(cfg.intermediate_size, rank, world))
        mlp.intermediate = local.intermediate_size
    model.cfg = local
    return wrap_row_parallel(model, group)
