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


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_mode_on_cuda_keeps_one_device_and_greedy_equals_ar(tiny_model, temperature):
    """Workers, rules, trees and samplers on a CUDA model under DeviceDiscipline (no op may mix devices,
    no tensor may default to the CPU); greedy output of every mode equals ar's."""
    import copy

    from calid.decoding.modes import MODES, DecodeParams
    from calid.models.self_draft import self_draft
    from calid.runtime.device_check import DeviceDiscipline

    model = copy.deepcopy(tiny_model).to("cuda")
    engine = Engine(ModelRunner(model), _Tok(), frozenset(), draft=ModelRunner(self_draft(model, 1)))

    def run(mode):
        reqs = [GenerationRequest([1, 2, 3, 4 + i], SamplingParams(max_new_tokens=8, temperature=temperature, seed=i,
                                                                   ignore_eos=True), decode=DecodeParams(mode=mode))
                for i in range(3)]
        with DeviceDiscipline():
            return [r.output_ids for r in engine.generate(reqs)]

    outputs = {mode: run(mode) for mode in MODES}
    assert all(len(ids) == 8 for out in outputs.values() for ids in out)
    if temperature == 0.0:
        lossless = [m for m in MODES if m not in ("filter", "rollback")]
        assert all(outputs[m] == outputs["ar"] for m in lossless), {m: outputs[m] for m in lossless}


class _Tok:
    def decode(self, ids, **kw):
        return " ".join(map(str, ids))
