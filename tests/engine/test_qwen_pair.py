"""The real Qwen2.5-Coder pair (0.5B draft, 1.5B target) against HF transformers. Slow: run with -m slow."""
import gc

import pytest
import torch

from calid.engine import Engine
from calid.generation import GenerationRequest, SamplingParams
from calid.models.loader import load_model
from calid.models.presets import DEFAULT_DRAFT, DEFAULT_TARGET
from calid.runtime.runner import ModelRunner, SeqInput
from calid.text import encode_prompt

pytestmark = [pytest.mark.slow, pytest.mark.model]

PROMPTS = ["Write a Python function that merges two sorted lists.", "What does the `yield` keyword do in Python?"]


@pytest.fixture(scope="module", params=[DEFAULT_TARGET, DEFAULT_DRAFT])
def pair(request):
    from transformers import AutoModelForCausalLM

    lm = load_model(request.param, show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(str(lm.path), dtype=torch.float32).eval()
    yield lm, hf
    del lm, hf
    gc.collect()


def test_logits_match_hf(pair):
    lm, hf = pair
    ids = encode_prompt(lm.tokenizer, PROMPTS[0])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = ModelRunner(lm.model).forward([SeqInput("p", ids, logits_at=list(range(len(ids))))])[0]
    assert (got - ref).abs().max().item() < 2e-3  # fp32, 28/24 layers, |logits| up to ~40
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_greedy_matches_hf_generate(pair):
    lm, hf = pair
    reqs = [GenerationRequest(encode_prompt(lm.tokenizer, p), SamplingParams(max_new_tokens=32)) for p in PROMPTS]
    results = Engine(ModelRunner(lm.model), lm.tokenizer, lm.eos_ids).generate(reqs)
    for req, res in zip(reqs, results):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([req.prompt_ids]), max_new_tokens=32, do_sample=False)
        assert res.output_ids == ref[0, len(req.prompt_ids):].tolist()


def test_draft_and_target_share_a_vocabulary():
    from calid.models.loader import load_tokenizer
    from calid.models.source import resolve

    a = load_tokenizer(resolve(DEFAULT_DRAFT, show_progress=False).path)
    b = load_tokenizer(resolve(DEFAULT_TARGET, show_progress=False).path)
    assert a.get_vocab() == b.get_vocab()


def test_greedy_speculative_with_the_qwen_draft_is_identical_to_the_target():
    from calid.decoding.modes import DecodeParams
    from calid.engine import Engine

    target = load_model(DEFAULT_TARGET, show_progress=False)
    draft = load_model(DEFAULT_DRAFT, show_progress=False)
    reqs = lambda d: [GenerationRequest(encode_prompt(target.tokenizer, p), SamplingParams(max_new_tokens=48), decode=d)
                      for p in PROMPTS]
    eng = Engine(ModelRunner(target.model), target.tokenizer, target.eos_ids, draft=ModelRunner(draft.model))
    ar = eng.generate(reqs(DecodeParams(mode="ar")))
    spec = eng.generate(reqs(DecodeParams(mode="speculative", gamma=5)))
    assert [r.output_ids for r in spec] == [r.output_ids for r in ar]
    assert all(r.stats.mean_accepted > 1.0 for r in spec)


def test_greedy_tree_and_lookahead_on_the_qwen_target_are_identical_to_the_target():
    from calid.decoding.modes import DecodeParams
    from calid.engine import Engine

    target = load_model(DEFAULT_TARGET, show_progress=False)
    draft = load_model(DEFAULT_DRAFT, show_progress=False)
    reqs = lambda d: [GenerationRequest(encode_prompt(target.tokenizer, p), SamplingParams(max_new_tokens=40), decode=d)
                      for p in PROMPTS]
    eng = Engine.from_loaded(target, draft)
    ar = [r.output_ids for r in eng.generate(reqs(DecodeParams(mode="ar")))]
    assert [r.output_ids for r in eng.generate(reqs(DecodeParams(mode="tree", gamma=6, threshold=0.6)))] == ar
    assert [r.output_ids for r in eng.generate(reqs(DecodeParams(mode="lookahead", gamma=12)))] == ar
