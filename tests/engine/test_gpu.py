"""CUDA path: same greedy output on GPU as on CPU. Skips cleanly without a GPU."""
import pytest
import torch

from calid.engine import Engine
from calid.generation import GenerationRequest, SamplingParams
from calid.models.loader import build_model, load_state_dict
from calid.runtime.runner import ModelRunner
from calid.text import encode_prompt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.model,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_greedy_matches_cpu(smol, prompts, dtype):
    gpu_model = build_model(smol.config, load_state_dict(smol.path), dtype, "cuda")
    reqs = lambda: [GenerationRequest(encode_prompt(smol.tokenizer, p), SamplingParams(max_new_tokens=24)) for p in prompts]
    cpu = Engine(ModelRunner(smol.model), smol.tokenizer, smol.eos_ids).generate(reqs())
    gpu = Engine(ModelRunner(gpu_model), smol.tokenizer, smol.eos_ids).generate(reqs())
    same = sum(a.output_ids == b.output_ids for a, b in zip(cpu, gpu))
    assert same == len(prompts) if dtype == torch.float32 else same >= 1
