"""The Qwen2.5-Coder pair on the llama.cpp backend (Q4_K_M GGUFs read in place). Slow: run with -m slow."""
import pytest

from calid.backends import open_model
from calid.decoding.modes import DecodeParams
from calid.engine import Engine
from calid.generation import GenerationRequest, SamplingParams
from calid.models.presets import DEFAULT_DRAFT, DEFAULT_TARGET
from calid.text import encode_prompt

pytestmark = [pytest.mark.slow, pytest.mark.model]

PROMPTS = ["Write a Python function that merges two sorted lists.", "What does the `yield` keyword do in Python?"]
QUIET = dict(log=lambda line: None, show_progress=False)


@pytest.fixture(scope="module")
def pair():
    target = open_model(DEFAULT_TARGET, backend="llamacpp", **QUIET)
    draft = open_model(DEFAULT_DRAFT, backend="llamacpp", **QUIET)
    return target, draft, Engine.from_models(target, draft)


def _run(pair, decode, n=40):
    target, _, eng = pair
    return eng.generate([GenerationRequest(encode_prompt(target.tokenizer, p), SamplingParams(max_new_tokens=n),
                                           decode=decode) for p in PROMPTS])


@pytest.fixture(scope="module")
def ar(pair):
    return [r.output_ids for r in _run(pair, DecodeParams(mode="ar"))]


@pytest.mark.parametrize("decode", [
    DecodeParams(mode="speculative", gamma=5, threshold=0.0),
    DecodeParams(mode="speculative"),
    DecodeParams(mode="tree", gamma=6, threshold=0.6),
    DecodeParams(mode="lookahead", gamma=12),
    DecodeParams(mode="auto"),
])
def test_lossless_modes_reproduce_ar_on_the_qwen_pair(pair, ar, decode):
    res = _run(pair, decode)
    assert [r.output_ids for r in res] == ar
    if decode.mode in ("speculative", "tree"):
        assert all(r.stats.mean_accepted > 1.0 for r in res)


def test_filter_extremes_on_the_qwen_pair(pair, ar):
    target, draft, _ = pair
    draft_alone = Engine(draft.runner, draft.tokenizer, draft.eos_ids)
    want = [r.output_ids for r in draft_alone.generate([
        GenerationRequest(encode_prompt(target.tokenizer, p), SamplingParams(max_new_tokens=40)) for p in PROMPTS])]
    assert [r.output_ids for r in _run(pair, DecodeParams(mode="filter", threshold=0.0))] == want
    assert [r.output_ids for r in _run(pair, DecodeParams(mode="filter", threshold=1.0))] == ar


def test_exact_mode_gives_a_prompts_rows_however_it_is_chunked_or_borrowed(pair):
    """Qwen's Q4_K_M target in exact mode (its repacked matmuls give a row differently from four rows on): a
    prompt's last row is the same prefilled whole, in the chunks the runner asks for (chunk_length), and after a
    prefix borrowed from a live sequence. Before the runner aligned both, a chunk ending at 45 moved it by 0.37
    and a 20-token borrow by 0.37."""
    import torch

    from calid.runtime.runner import SeqInput

    r = pair[0].runner
    assert r.exact
    ids = [(11 * j) % 900 + 7 for j in range(70)]
    whole = r.forward([SeqInput("whole", ids)])[0][-1]
    r.release("whole")
    first = r.chunk_length(0, 45, len(ids))
    assert first == 32
    r.forward([SeqInput("chunked", ids[:first])])
    assert torch.equal(r.forward([SeqInput("chunked", ids[first:])])[0][-1], whole)
    r.release("chunked")
    for shared in (20, 45):
        r.forward([SeqInput("donor", ids[:shared] + [5] * 10)])
        got = r.forward([SeqInput("borrower", r.sync("borrower", ids))])[0][-1]
        assert torch.equal(got, whole), shared
        for s in ("donor", "borrower"):
            r.release(s)
