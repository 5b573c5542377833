"""Every tensor calid's decoding code creates follows the model's device (calid.runtime.device_check).

A CUDA target fails at once if a worker, rule, tree or sampler builds a tensor on the CPU and mixes it
with the model's logits. Without a GPU the mistake is made visible on the CPU: every factory call from
calid's own code must name its device. The GPU tests run the same mode on CUDA, where the check that no
op takes two devices bites too.
"""
from __future__ import annotations

import pytest
import torch

from calid.decoding.modes import MODES, DecodeParams
from calid.engine import Engine
from calid.generation import GenerationRequest, SamplingParams
from calid.runtime.device_check import CALID, DeviceDiscipline, DeviceMixError
from calid.runtime.runner import ModelRunner

@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_mode_keeps_its_tensors_on_the_models_device(tiny_model, temperature):
    from calid.models.self_draft import self_draft

    engine = Engine(ModelRunner(tiny_model), _Tok(), frozenset(), draft=ModelRunner(self_draft(tiny_model, 1)))
    reqs = [GenerationRequest([1, 2, 3, 4 + i], SamplingParams(max_new_tokens=6, temperature=temperature, seed=i,
                                                               ignore_eos=True),
                              decode=DecodeParams(mode=mode, **({"tree_chains": 2} if mode == "tree" else {})))
            for i, mode in enumerate(MODES)]
    mode = DeviceDiscipline()
    with mode:
        out = engine.generate(reqs)
    assert all(len(r.output_ids) == 6 for r in out)
    assert mode.checked > 100  # the mode really saw calid's calls


def test_the_discipline_catches_a_cpu_default():
    """The check itself: code under calid/ that builds a tensor without a device is refused."""
    from calid.decoding import acceptance

    x = acceptance.RuleInput(draft=torch.tensor([1], device="cpu"), q=None, p=torch.full((2, 4), 0.25, device="cpu"))
    with DeviceDiscipline():
        acceptance.rollback_rule(acceptance.RuleInput(x.draft[:0], None, x.p))  # fine: device given
    src = compile("import torch\ntorch.zeros(3)\n", CALID + "/_probe.py", "exec")
    with pytest.raises(DeviceMixError, match="zeros without device="), DeviceDiscipline():
        exec(src, {})


def test_a_generator_state_from_another_device_kind_continues_deterministically():
    from calid.workers.messages import load_generator, save_generator

    cpu_state = torch.Generator().manual_seed(7).get_state()
    foreign = torch.arange(16, dtype=torch.uint8)  # the size of a CUDA (Philox) generator's state
    a, b = load_generator(foreign), load_generator(foreign)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    assert torch.equal(save_generator(load_generator(cpu_state)), cpu_state)


class _Tok:
    def decode(self, ids, **kw):
        return " ".join(map(str, ids))
