"""Pipeline parallelism (and PP x TP) on CPU: gloo over loopback, one process per rank.

Every rank loads only its slice of the checkpoint (calid.parallel.shard), runs
the same engine over the same requests, and must produce the single-process
model's logits and greedy tokens: chains (ar, speculative) and token trees
(lookahead: tree masks and cache compaction on every stage).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from calid.decoding.modes import DecodeParams
from calid.engine import Engine
from calid.generation import GenerationRequest, SamplingParams
from calid.models.loader import load_tokenizer, load_weights, weight_footprint
from calid.models.self_draft import self_draft
from calid.parallel.local_group import run_ranks
from calid.parallel.layout import stage_layers
from calid.runtime.runner import ModelRunner, SeqInput

TINY_PROMPTS = [[5, 17, 3, 5, 17], [88, 41, 9, 60, 2, 88, 41], [7]]
SMOL_PROMPTS = ["Write a Python function that checks whether a number is prime.", "List three colors of the rainbow."]


class IdTokenizer:
    def decode(self, ids, **kw):
        return " ".join(map(str, ids))


def _tokenizer(path: Path):
    return load_tokenizer(path) if (path / "tokenizer_config.json").is_file() else IdTokenizer()


def _generate(target: ModelRunner, path: Path, prompts, mode: str, max_new: int, draft_layers: int,
              device: str = "cpu") -> list:
    draft = ModelRunner(self_draft(load_weights(path, device=device), draft_layers)) if mode == "speculative" else None
    engine = Engine(target, _tokenizer(path), frozenset(), draft=draft)
    reqs = [GenerationRequest(list(p), SamplingParams(max_new_tokens=max_new), decode=DecodeParams(mode=mode))
            for p in prompts]
    return [r.output_ids for r in engine.generate(reqs)]


def _all_logits(runner: ModelRunner, prompts) -> list:
    return runner.forward([SeqInput(i, list(p), logits_at=list(range(len(p)))) for i, p in enumerate(prompts)])


def group_job(path: str, tp: int, pp: int, micro_batches: int, prompts, modes, max_new: int, draft_layers: int,
              device: str = "cpu"):
    from calid.parallel.layout import Layout
    from calid.parallel.shard import build_shard

    path = Path(path)
    shard = build_shard(path, Layout(tp, pp, micro_batches), device=device)
    runner = shard.runner()
    logits = [row.cpu() for row in _all_logits(runner, prompts)]
    cache = runner.caches.get(0)
    return {"logits": logits, "kv": (cache.num_layers, cache.shape[0]), "weight_bytes": shard.weight_bytes,
            "outputs": {m: _generate(shard.runner(), path, prompts, m, max_new, draft_layers, device) for m in modes}}


def _check_group(path: Path, tp: int, pp: int, micro_batches: int, prompts, modes, max_new: int,
                 draft_layers: int, atol: float, device: str = "cpu") -> list:
    full = load_weights(path, device=device)
    want_logits = [row.cpu() for row in _all_logits(ModelRunner(full), prompts)]
    want = {m: _generate(ModelRunner(full), path, prompts, m, max_new, draft_layers, device) for m in modes}
    full_bytes = weight_footprint(full)[0]
    layers = full.cfg.num_layers
    got = run_ranks(tp * pp, group_job, str(path), tp, pp, micro_batches, prompts, modes, max_new, draft_layers,
                    device, device=device, threads=1)
    for rank, g in enumerate(got):
        stage = rank // tp
        assert g["kv"][1] == full.cfg.num_kv_heads // tp
        assert g["kv"][0] == len(stage_layers(layers, pp)[stage])  # each stage caches only its own layers
        assert g["weight_bytes"] < full_bytes  # each rank holds only its slice
        for a, w in zip(g["logits"], want_logits):
            assert (a - w).abs().max() <= atol, f"rank {rank}: max |diff| {(a - w).abs().max():.2e}"
            assert torch.equal(a.argmax(-1), w.argmax(-1))
        assert g["outputs"] == want, f"rank {rank}"
    return got


@pytest.mark.parametrize("tp,pp,micro_batches", [(1, 2, 2), (2, 2, 2), (1, 2, 1)])
def test_tiny_pipeline_equals_the_single_process_model(tiny_checkpoint, tp, pp, micro_batches):
    _check_group(tiny_checkpoint, tp, pp, micro_batches, TINY_PROMPTS, ["ar", "speculative", "lookahead"],
                 max_new=12, draft_layers=1, atol=1e-5)


@pytest.mark.model
@pytest.mark.parametrize("tp,pp", [(1, 2), (3, 2)])
def test_smollm_pp_and_tp_x_pp_equal_the_single_process_model(smol, tp, pp):
    from calid.text import encode_prompt

    prompts = [encode_prompt(smol.tokenizer, p) for p in SMOL_PROMPTS]
    modes = ["ar", "lookahead"] + (["speculative"] if tp == 1 else [])
    got = _check_group(Path(smol.path), tp, pp, 2, prompts, modes, max_new=16, draft_layers=10, atol=2e-4)
    assert [g["kv"][0] for g in got] == [15] * tp + [15] * tp  # 30 layers over 2 stages


@pytest.mark.slow
def test_qwen_target_tp2_x_pp2_equals_the_single_process_model():
    """Qwen2.5-Coder-1.5B (28 layers, 12 query / 2 KV heads) over 2 stages of 2 tensor-parallel ranks."""
    from calid.models.loader import load_tokenizer
    from calid.models.presets import DEFAULT_TARGET
    from calid.models.source import resolve
    from calid.text import encode_prompt

    path = resolve(DEFAULT_TARGET).path
    prompts = [encode_prompt(load_tokenizer(path), p) for p in SMOL_PROMPTS]
    got = _check_group(Path(path), 2, 2, 2, prompts, ["ar", "lookahead"], max_new=16, draft_layers=0,
                       atol=2e-3)
    assert [g["kv"][0] for g in got] == [14, 14, 14, 14]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL pipeline needs 2 CUDA GPUs")
def test_nccl_pp2_equals_one_gpu(smol):
    from calid.text import encode_prompt

    prompts = [encode_prompt(smol.tokenizer, p) for p in SMOL_PROMPTS]
    _check_group(Path(smol.path), 1, 2, 2, prompts, ["ar", "lookahead"], max_new=16, draft_layers=0, atol=1e-3,
                 device="cuda")


@pytest.mark.model
@pytest.mark.parametrize("argv, message", [
    (["--pp", "31"], "pipeline parallel size 31 exceeds the model's 30 layers"),
    (["--tp", "2"], "tensor parallel size 2 does not divide the model's 9 query heads"),
    (["--tp", "1", "--pp", "1"], "nothing to compare"),
])
def test_bench_parallel_refuses_a_layout_in_one_line(smol, capsys, argv, message):
    from serve_app.main import main

    assert main(["bench", "parallel", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("calid: error: ") and message in err and err.count("\n") == 1
