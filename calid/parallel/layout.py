"""Where a shard sits in a TP x PP target group, and which part of the model it holds.

A group of ``tp * pp`` ranks: ``pp`` pipeline stages, each a run of consecutive
layers, and within a stage ``tp`` tensor-parallel ranks that split every
layer's heads and MLP width. Global rank = stage * tp + tp_rank, so the ranks
of one stage are adjacent (they share a node; stages may not).

Tensor-parallel slices are contiguous ranges of one dimension of a HF tensor:
q/k/v and gate/up split their output rows, o and down their input columns.
Because head counts divide evenly, an equal split of the rows is also a split
by whole heads.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from calid.errors import CalidError
from calid.models.config import ModelConfig


class ParallelConfigError(CalidError):
    """A tensor/pipeline-parallel layout that this model cannot take."""


def check_layout(cfg: ModelConfig, tp: int = 1, pp: int = 1) -> None:
    """Raise ParallelConfigError unless ``tp`` divides heads, KV heads and MLP width and ``1 <= pp <= layers``."""
    if tp < 1:
        raise ParallelConfigError(f"tensor parallel size must be >= 1, got {tp}")
    for what, n in (("query heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                    ("MLP intermediate size", cfg.intermediate_size)):
        if n % tp:
            raise ParallelConfigError(f"tensor parallel size {tp} does not divide the model's {n} {what}")
    if pp < 1:
        raise ParallelConfigError(f"pipeline parallel size must be >= 1, got {pp}")
    if pp > cfg.num_layers:
        raise ParallelConfigError(f"pipeline parallel size {pp} exceeds the model's {cfg.num_layers} layers "
                                  "(every stage needs at least one)")


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Consecutive layer ranges, one per stage; the first stages take the remainder (the last one has the head)."""
    base, extra = divmod(num_layers, pp)
    ranges, start = [], 0
    for stage in range(pp):
        n = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + n))
        start += n
    return ranges


def tp_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share [start, end) of ``n`` rows or columns (``world`` divides ``n``)."""
    return rank * n // world, (rank + 1) * n // world


@dataclass(frozen=True)
class ShardSpec:
    """One rank of a ``tp`` x ``pp`` group."""

    tp_rank: int = 0
    tp: int = 1
    stage: int = 0
    pp: int = 1

    @property
    def rank(self) -> int:
        return self.stage * self.tp + self.tp_rank

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def whole(self) -> bool:
        return self.tp == 1 and self.pp == 1

    def layers(self, cfg: ModelConfig) -> range:
        return stage_layers(cfg.num_layers, self.pp)[self.stage]

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config of this shard's model: its own layer count, local heads and MLP width."""
        check_layout(cfg, self.tp, self.pp)
        return replace(cfg, num_layers=len(self.layers(cfg)), num_heads=cfg.num_heads // self.tp,
                       num_kv_heads=cfg.num_kv_heads // self.tp, intermediate_size=cfg.intermediate_size // self.tp)


@dataclass(frozen=True)
class Layout:
    """A TP x PP group: ``micro_batches`` splits each pipelined forward (None: one per stage)."""

    tp: int = 1
    pp: int = 1
    micro_batches: int | None = None

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def shard(self, rank: int) -> ShardSpec:
        if not 0 <= rank < self.world:
            raise ParallelConfigError(f"rank {rank} is outside a group of {self.world}")
        stage, tp_rank = divmod(rank, self.tp)
        return ShardSpec(tp_rank, self.tp, stage, self.pp)

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp, (stage + 1) * self.tp))
