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

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from calid.errors import CalidError
from calid.models.config import ModelConfig
from calid.models.llama import LlamaModel


class ParallelConfigError(CalidError):
    """A tensor/pipeline-parallel layout that this model cannot take."""


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    if tp < 1:
        raise ParallelConfigError(f"tensor parallel size must be >= 1, got {tp}")
    for what, n in (("query heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                    ("MLP intermediate size", cfg.intermediate_size)):
        if n % tp:
            raise ParallelConfigError(f"tensor parallel size {tp} does not divide the model's {n} {what}")


class AllReduce(nn.Module):
    """A row-parallel projection: the local partial product, summed over the group."""

    def __init__(self, linear: nn.Module, group=None):
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        dist.all_reduce(out, group=self.group)
        return out


def _keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    linear.out_features = len(rows)


def _keep_columns(linear: nn.Linear, start: int, end: int) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[:, start:end].clone(), requires_grad=False)
    linear.in_features = end - start


def _span(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n)


def apply_tensor_parallel(model: LlamaModel, rank: int, world: int, group=None) -> LlamaModel:
    """Turn ``model`` into shard ``rank`` of ``world`` (in place; returns it)."""
    cfg = model.cfg
    check_tensor_parallel(cfg, world)
    if world == 1:
        return model
    d, heads, kv, inter = cfg.head_dim, cfg.num_heads // world, cfg.num_kv_heads // world, cfg.intermediate_size // world
    q_rows = _span(rank * heads * d, heads * d)
    k_rows = _span(cfg.num_heads * d + rank * kv * d, kv * d)
    v_rows = _span((cfg.num_heads + cfg.num_kv_heads) * d + rank * kv * d, kv * d)
    gate_up_rows = torch.cat([_span(rank * inter, inter), _span(cfg.intermediate_size + rank * inter, inter)])
    for block in model.layers:
        attn, mlp = block.attn, block.mlp
        _keep_rows(attn.wqkv, torch.cat([q_rows, k_rows, v_rows]))
        _keep_columns(attn.wo, rank * heads * d, (rank + 1) * heads * d)
        attn.wo = AllReduce(attn.wo, group)
        attn.num_heads, attn.num_kv_heads = heads, kv
        _keep_rows(mlp.w_gate_up, gate_up_rows)
        _keep_columns(mlp.w_down, rank * inter, (rank + 1) * inter)
        mlp.w_down = AllReduce(mlp.w_down, group)
        mlp.intermediate = inter
    model.cfg = replace(cfg, num_heads=heads, num_kv_heads=kv, intermediate_size=inter)
    return model
