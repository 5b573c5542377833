"""Pure pieces of model parallelism: layouts, edge checks, micro-batches, slice loading (tiny model)."""
from __future__ import annotations

import copy

import pytest
import torch

from calid.models.config import ModelConfig
from calid.models.loader import build_model, load_state_dict, weight_footprint
from calid.parallel.layout import Layout, ParallelConfigError, ShardSpec, check_layout, stage_layers
from calid.parallel.pp import StageLinks
from calid.parallel.tp import apply_tensor_parallel
from calid.runtime.batch import split_batch
from calid.runtime.runner import ModelRunner, SeqInput


def test_stage_layers_cover_every_layer_once_and_the_first_stages_take_the_rest():
    assert stage_layers(30, 2) == [range(0, 15), range(15, 30)]
    assert [len(r) for r in stage_layers(30, 4)] == [8, 8, 7, 7]
    assert stage_layers(2, 2) == [range(0, 1), range(1, 2)]
    for n, pp in [(28, 3), (30, 7), (5, 5)]:
        assert [i for r in stage_layers(n, pp) for i in r] == list(range(n))


def test_layout_edge_checks_name_the_problem(tiny_cfg):
    check_layout(tiny_cfg, tp=2, pp=2)
    with pytest.raises(ParallelConfigError, match="pipeline parallel size 3 exceeds the model's 2 layers"):
        check_layout(tiny_cfg, pp=3)
    with pytest.raises(ParallelConfigError, match="pipeline parallel size must be >= 1"):
        check_layout(tiny_cfg, pp=0)
    with pytest.raises(ParallelConfigError, match="tensor parallel size 4 does not divide the model's 6 query heads"):
        check_layout(tiny_cfg, tp=4)
    with pytest.raises(ParallelConfigError, match="does not divide the model's 2 KV heads"):
        check_layout(tiny_cfg, tp=3)


def test_ranks_of_a_stage_are_adjacent_and_links_join_the_same_tensor_rank():
    layout = Layout(tp=3, pp=2)
    assert layout.shard(4) == ShardSpec(tp_rank=1, tp=3, stage=1, pp=2)
    assert layout.stage_ranks(1) == [3, 4, 5]
    assert StageLinks.of(layout, 1) == StageLinks(prev=None, next=4, last=3)
    assert StageLinks.of(layout, 4) == StageLinks(prev=1, next=None, last=3)
    mid = StageLinks.of(Layout(tp=1, pp=3), 1)
    assert (mid.prev, mid.next, mid.last) == (0, 2, 2)
    with pytest.raises(ParallelConfigError, match="rank 6 is outside a group of 6"):
        layout.shard(6)


def _batch(model, lengths):
    runner = ModelRunner(model)
    inputs = [SeqInput(i, list(range(1, n + 1)), logits_at=list(range(n))) for i, n in enumerate(lengths)]
    return runner._build_batch(inputs)


def test_micro_batches_are_whole_sequences_and_give_the_same_logits(tiny_model):
    lengths = [5, 1, 7, 2]
    want = tiny_model(_batch(tiny_model, lengths))
    parts = split_batch(_batch(tiny_model, lengths), 2)
    assert [len(p.seqs) for p in parts] == [2, 2]
    assert [p.seqs[0].start for p in parts] == [0, 0] and [len(p.input_ids) for p in parts] == [6, 9]
    got = torch.cat([tiny_model(p) for p in parts])
    assert torch.allclose(got, want, atol=1e-6)
    assert len(split_batch(_batch(tiny_model, lengths), 9)) == 4  # never more parts than sequences
    assert len(split_batch(_batch(tiny_model, [30, 1, 1]), 3)) == 3  # a long head does not swallow the rest
    one = _batch(tiny_model, lengths)
    assert split_batch(one, 1) == [one]


def test_a_shard_reads_only_its_slice_of_the_checkpoint(tiny_tied, tiny_checkpoint):
    cfg = ModelConfig.from_dir(tiny_checkpoint)
    full_bytes = weight_footprint(tiny_tied)[0]
    for rank in range(4):
        spec = Layout(tp=2, pp=2).shard(rank)
        ckpt = load_state_dict(tiny_checkpoint, spec)
        shard = build_model(cfg, ckpt, torch.float32, "cpu", spec)
        held = weight_footprint(shard)[0]
        assert ckpt.read_bytes == held < full_bytes / 2  # nothing read that the shard does not keep
        assert (shard.embed is not None, shard.lm_head is not None) == (spec.first, spec.last)
        assert shard.cfg.num_layers == 1 and shard.cfg.num_heads == 3 and shard.cfg.num_kv_heads == 1
        ref = apply_tensor_parallel(copy.deepcopy(tiny_tied), spec.tp_rank, 2)  # the same slices, cut in memory
        ours, theirs = shard.layers[0], ref.layers[spec.stage]
        for name in ("attn.wqkv.weight", "attn.wqkv.bias", "mlp.w_gate_up.weight", "attn_norm.weight"):
            assert torch.equal(ours.get_parameter(name), theirs.get_parameter(name)), name
        assert torch.equal(ours.attn.wo.weight, theirs.attn.wo.linear.weight)
        assert torch.equal(ours.mlp.w_down.weight, theirs.mlp.w_down.linear.weight)
        if spec.last:  # tied head read from the embedding on a stage without one
            assert torch.equal(shard.lm_head.weight, tiny_tied.embed.weight)


def test_the_whole_model_loads_from_the_checkpoint_unchanged(tiny_tied, tiny_checkpoint):
    ckpt = load_state_dict(tiny_checkpoint)
    model = build_model(ModelConfig.from_dir(tiny_checkpoint), ckpt, torch.float32, "cpu")
    batch = lambda m: _batch(m, [4, 3])  # noqa: E731
    assert torch.equal(model(batch(model)), tiny_tied(batch(tiny_tied)))
    assert model.lm_head.weight is model.embed.weight
