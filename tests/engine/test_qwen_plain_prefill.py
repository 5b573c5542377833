"""The Qwen 1.5B target (Q4_K_M: llama.cpp repacks its matrices) prefilled on its unrepacked weights.

The two kernels round differently, so the rows are not bit-identical to a runner that prefills on the repacked
weights; they must be the same computation: logits within rounding, the same greedy tokens. Slow: -m slow.
"""
import pytest

from calid.backends import gguf_file
from calid.models.presets import DEFAULT_TARGET
from calid.runtime.llamacpp import LlamaCppRunner
from calid.runtime.runner import SeqInput
from calid.text import encode_prompt
from calid.models.loader import load_tokenizer
from calid.models.gguf_meta import gguf_companion

pytestmark = [pytest.mark.slow, pytest.mark.model]

CODE = """def merge(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]
"""
PROMPTS = [f"Add type hints and a docstring to this function:\n{CODE}",  # long enough for the plain weights
           f"Explain what this function returns for merge([1, 4], [2, 3]):\n{CODE}\nThen write two tests for it.",
           "What does the `yield` keyword do in Python?"]  # short: its tail stays on the repacked weights


@pytest.fixture(scope="module")
def runners():
    gguf = gguf_file(DEFAULT_TARGET, show_progress=False)
    tok = load_tokenizer(gguf_companion(DEFAULT_TARGET, gguf))
    split = LlamaCppRunner(gguf, 256 << 20, exact=False, prompt_cache=True, plain_prefill=True, slots=8)
    one = LlamaCppRunner(gguf, 256 << 20, exact=False, prompt_cache=True, plain_prefill=False, slots=8)
    yield tok, split, one
    split.close()
    one.close()


def test_prompts_prefilled_on_plain_weights_decode_the_same_greedy_tokens(runners):
    tok, split, one = runners
    ids = [encode_prompt(tok, p) for p in PROMPTS]
    tokens = {}
    for r in (split, one):
        # together, unequal lengths, sharing the chat template's system prompt (a borrowed or forked prefix)
        rows = r.forward([SeqInput(k, list(x)) for k, x in enumerate(ids)])
        seqs = {k: [int(row[-1].argmax())] for k, row in enumerate(rows)}
        for _ in range(12):
            out = r.forward([SeqInput(k, [s[-1]]) for k, s in seqs.items()])
            for k, row in zip(seqs, out):
                seqs[k].append(int(row[-1].argmax()))
        tokens[r] = (rows, seqs)
    assert split.stats.plain_prefill_tokens >= 150
    (rows_s, seqs_s), (rows_o, seqs_o) = tokens[split], tokens[one]
    for a, b in zip(rows_s, rows_o):
        assert (a - b).abs().max() < 1.5  # rounding (measured ~0.4); a stale or misplaced cell moves them by far more
    assert seqs_s == seqs_o
