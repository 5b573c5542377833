"""CUDA path: every mode correct on the GPU. Skips cleanly without a GPU.

Runs from a plain checkout with torch, transformers and pytest only: the SmolLM2 test needs the model
pulled (``calid models pull``) and skips otherwise; the rest use seeded random weights.
"""
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


def _smol_pulled() -> bool:
    from calid.models.presets import TEST_MODEL
    from calid.models.source import preset_status

    return preset_status(TEST_MODEL) != "not pulled"


@pytest.mark.skipif(not _smol_pulled(), reason="needs SmolLM2 pulled (no network)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_greedy_matches_cpu(smol, prompts, dtype):
    gpu_model = build_model(smol.config, load_state_dict(smol.path), dtype, "cuda")
    reqs = lambda: [
        GenerationRequest(encode_prompt(smol.tokenizer, p), SamplingParams(max_new_tokens=24)) for p in prompts
    ]
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


def test_every_lossless_mode_greedy_equals_ar_on_cuda_through_the_paged_runtime():
    from calid.bench.gpu import check_greedy_modes

    same = check_greedy_modes("cuda")
    assert all(same.values()), same


@pytest.mark.parametrize("mode", ["speculative", "tree"])
def test_sampled_decoding_on_cuda_follows_the_target_distribution(mode):
    from calid.bench.gpu import sampled_tv

    tv_target, tv_draft = sampled_tv("cuda", mode)
    assert tv_target < 0.05 and tv_draft > 0.2, (tv_target, tv_draft)


def test_bench_gpu_runs_every_mode_beside_hf_generate(tmp_path):
    from calid.bench.gpu import main

    assert main(["--pair", "tiny", "--batches", "1,8", "--new-tokens", "8", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "gpu-tiny.json").is_file()


def test_cuda_graphs_capture_decode_steps_and_replay_them_with_eager_output(tiny_model):
    import copy

    from calid.runtime.runner import SeqInput

    model = copy.deepcopy(tiny_model).to("cuda")
    runners = {"eager": ModelRunner(model), "graphs": ModelRunner(model, graphs="cuda", graph_batch_sizes=(1, 4))}
    ids = {k: {s: [s + 3, 7, 11] for s in range(3)} for k in runners}
    for k, runner in runners.items():
        for _ in range(12):  # 3 sequences in the bucket of 4: a padding row every step
            logits = runner.forward([SeqInput(s, runner.sync(s, ids[k][s])) for s in ids[k]])
            for s, row in zip(ids[k], logits):
                ids[k][s].append(int(row[-1].argmax()))
    assert ids["graphs"] == ids["eager"]
    graphs = runners["graphs"].graphs
    assert graphs.captures >= 1 and graphs.replays >= 11
