"""Tensor parallelism on CPU: gloo over loopback, one process per rank, SmolLM2-135M (9 query / 3 KV heads)."""
from __future__ import annotations

import pytest
import torch

from calid.parallel.local_group import run_ranks
from calid.parallel.tp import ParallelConfigError, check_tensor_parallel

pytestmark = pytest.mark.model
PROMPTS = ["Write a Python function that checks whether a number is prime.", "What is the capital of France?"]


def tp_job(world: int, model_spec: str | None = None) -> dict:
    """The whole model loaded, then turned into this rank's shard in memory (apply_tensor_parallel)."""
    import torch.distributed as dist

    from calid.engine import Engine
    from calid.generation import GenerationRequest, SamplingParams
    from calid.models.loader import load_model
    from calid.models.presets import TEST_MODEL
    from calid.parallel.tp import apply_tensor_parallel
    from calid.runtime.runner import ModelRunner, SeqInput
    from calid.text import encode_prompt

    lm = load_model(model_spec or TEST_MODEL, show_progress=False)
    model = apply_tensor_parallel(lm.model, dist.get_rank(), world)
    ids = [encode_prompt(lm.tokenizer, p) for p in PROMPTS]
    runner = ModelRunner(model)
    logits = runner.forward([SeqInput(i, t, logits_at=list(range(len(t)))) for i, t in enumerate(ids)])
    engine = Engine(ModelRunner(model), lm.tokenizer, lm.eos_ids)
    out = engine.generate([GenerationRequest(t, SamplingParams(max_new_tokens=16)) for t in ids])
    return {"logits": logits, "outputs": [r.output_ids for r in out], "kv_heads": runner.caches.get(0).shape[0]}


def test_tp_refuses_a_size_that_does_not_divide_the_heads(smol):
    with pytest.raises(ParallelConfigError, match="tensor parallel size 2 does not divide the model's 9 query heads"):
        check_tensor_parallel(smol.model.cfg, 2)
    check_tensor_parallel(smol.model.cfg, 3)


def test_tp3_logits_and_greedy_output_equal_the_single_process_model(smol):
    from calid.engine import Engine
    from calid.generation import GenerationRequest, SamplingParams
    from calid.runtime.runner import ModelRunner, SeqInput
    from calid.text import encode_prompt

    ranks = run_ranks(3, tp_job, 3, threads=1)
    ids = [encode_prompt(smol.tokenizer, p) for p in PROMPTS]
    want_logits = ModelRunner(smol.model).forward([SeqInput(i, t, logits_at=list(range(len(t))))
                                                   for i, t in enumerate(ids)])
    want = [r.output_ids for r in Engine(ModelRunner(smol.model), smol.tokenizer, smol.eos_ids).generate(
        [GenerationRequest(t, SamplingParams(max_new_tokens=16)) for t in ids])]
    for rank, got in enumerate(ranks):
        assert got["kv_heads"] == 1  # each shard caches only its own KV head
        for g, w in zip(got["logits"], want_logits):
            assert torch.allclose(g, w, atol=2e-4, rtol=0), f"rank {rank}: max |diff| {(g - w).abs().max():.2e}"
            assert torch.equal(g.argmax(-1), w.argmax(-1))
        assert got["outputs"] == want


@pytest.mark.slow
def test_qwen_target_tp2_equals_the_single_process_model():
    """Qwen2.5-Coder-1.5B (12 query / 2 KV heads) with TP=2; the reference is computed and freed first."""
    import gc

    from calid.engine import Engine
    from calid.generation import GenerationRequest, SamplingParams
    from calid.models.loader import load_model
    from calid.models.presets import DEFAULT_TARGET
    from calid.runtime.runner import ModelRunner, SeqInput
    from calid.text import encode_prompt

    lm = load_model(DEFAULT_TARGET, show_progress=False)
    ids = [encode_prompt(lm.tokenizer, p) for p in PROMPTS]
    want_logits = ModelRunner(lm.model).forward([SeqInput(i, t, logits_at=list(range(len(t))))
                                                 for i, t in enumerate(ids)])
    want = [r.output_ids for r in Engine(ModelRunner(lm.model), lm.tokenizer, lm.eos_ids).generate(
        [GenerationRequest(t, SamplingParams(max_new_tokens=16)) for t in ids])]
    del lm
    gc.collect()
    got = run_ranks(2, tp_job, 2, DEFAULT_TARGET, threads=1)[0]
    assert got["kv_heads"] == 1
    for g, w in zip(got["logits"], want_logits):
        assert (g - w).abs().max() < 2e-3 and torch.equal(g.argmax(-1), w.argmax(-1))
    assert got["outputs"] == want
