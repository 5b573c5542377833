"""Prompts prefilled on a second llama.cpp context over unrepacked weights (calid.runtime.plain_prefill,
calid.runtime.prefill_weights).

SmolLM2-135M's GGUF is Q4_1, a type llama.cpp does not repack on CPU: both contexts compute the same rows,
so a runner that prefills on the second context must give bit-identical logits to one that does not,
whatever the schedule (several prompts in one forward, a prompt in chunks, a prefix borrowed or forked
just before). That is what these tests hold it to.
"""
from __future__ import annotations

import pytest
import torch

from calid.backends import gguf_file
from calid.models.presets import TEST_MODEL
from calid.runtime.llamacpp import LlamaCppRunner
from calid.runtime.plain_prefill import PLAIN_MIN_TOKENS, PLAIN_RUN_TOKENS, PrefillWeightsError
from calid.runtime.prefill_weights import CHOICES, VERDICTS, check_choice, prefill_weights
from calid.runtime.runner import SeqInput
from calid.verdicts import read_verdicts

pytestmark = pytest.mark.model
MIN = 8  # prompt runs this long, and this many tokens of them, go to the plain context here (short prompts)


@pytest.fixture(scope="module")
def gguf():
    return gguf_file(TEST_MODEL, show_progress=False)


@pytest.fixture
def pair(gguf):
    """(a runner prefilling on plain weights, one that does not), each with a prompt cache."""
    split = LlamaCppRunner(gguf, 64 << 20, exact=False, prompt_cache=True, plain_prefill=True, slots=6)
    split.plain_min_tokens = split.plain_run_tokens = MIN
    one = LlamaCppRunner(gguf, 64 << 20, exact=False, prompt_cache=True, plain_prefill=False, slots=6)
    yield split, one
    split.close()
    one.close()


def prompt(seed: int, n: int) -> list[int]:
    return [(37 * seed + 11 * j) % 5000 + 300 for j in range(n)]


def both(pair, inputs):
    """Run ``inputs`` on both runners; their outputs."""
    return [r.forward([SeqInput(i.seq_id, list(i.tokens), logits_at=i.logits_at) for i in inputs]) for r in pair]


def assert_same(pair, inputs):
    got, want = both(pair, inputs)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def cont(*seqs, n: int = 3):
    return [SeqInput(s, [17 + k for k in range(n)], logits_at=list(range(n))) for s in seqs]


def test_prompts_of_unequal_lengths_prefilled_together_then_decode_as_on_one_context(pair):
    split, _ = pair
    assert_same(pair, [SeqInput("a", prompt(1, 40)), SeqInput("b", prompt(2, 23)), SeqInput("c", [5, 6])])
    assert split.stats.plain_prefill_tokens == 63  # "c" (2 tokens) ran on the repacked context
    assert_same(pair, cont("a", "b", "c"))


def test_short_prompt_runs_go_together_and_decode_steps_and_verifications_stay(pair):
    split, _ = pair
    split.plain_min_tokens, split.plain_run_tokens = PLAIN_MIN_TOKENS, PLAIN_RUN_TOKENS
    chunks = [SeqInput(f"s{k}", prompt(20 + k, 20)) for k in range(4)]  # 80 tokens together, 20 each
    assert_same(pair, chunks)
    assert split.stats.plain_prefill_tokens == 80
    verify = [SeqInput(f"s{k}", [9, 8, 7, 6], logits_at=[0, 1, 2, 3]) for k in range(2)]
    assert_same(pair, verify + [SeqInput("p", prompt(30, 40))])  # 40 prompt tokens: too few alone
    assert_same(pair, [SeqInput(f"s{k}", [5]) for k in range(4)])
    assert split.stats.plain_prefill_tokens == 80


def test_a_prompt_with_a_draft_chain_to_judge_after_it_is_prefilled_on_the_plain_weights(pair):
    """filter's first call: the prompt, then the draft's chain, rows asked only at the chain. Its rows are read
    from the plain context (bit-identical here); a run asking as many rows as tokens precede them stays."""
    split, _ = pair
    split.plain_min_tokens, split.plain_run_tokens = PLAIN_MIN_TOKENS, PLAIN_RUN_TOKENS
    p = prompt(11, 70)
    assert_same(pair, [SeqInput("a", p + [21, 22, 23, 24], logits_at=[69, 71, 73])])
    assert split.stats.plain_prefill_tokens == 74
    assert_same(pair, [SeqInput("b", prompt(12, 70), logits_at=list(range(40, 70)))])  # 30 rows after 40 tokens
    assert split.stats.plain_prefill_tokens == 74 + 70
    assert_same(pair, [SeqInput("c", prompt(13, 70), logits_at=list(range(20, 70)))])  # 50 rows after 20: stays
    assert split.stats.plain_prefill_tokens == 74 + 70
    assert_same(pair, cont("a", "b", "c"))


def test_a_prompt_in_chunks_continues_where_the_last_chunk_ended(pair):
    split, _ = pair
    p = prompt(3, 60)
    assert_same(pair, [SeqInput("a", p[:20])])
    assert_same(pair, [SeqInput("a", p[20:45]), SeqInput("b", prompt(4, 12))])
    assert_same(pair, [SeqInput("a", p[45:])])
    assert split.stats.plain_prefill_tokens == 60 + 12
    assert_same(pair, cont("a", "b"))
    # a rollback in the runner, then a long run again: the plain context must not reuse what it held past it
    for r in pair:
        r.truncate("a", 30)
    assert_same(pair, [SeqInput("a", prompt(5, 20))])
    assert_same(pair, cont("a"))


def test_a_borrowed_prefix_is_read_only_once_llama_cpp_has_copied_it(pair):
    """llama.cpp copies a stream between slots at the next decode; a state read before it sees the cells the
    slot held before. A sequence that borrowed its prefix feeds its first new token on the runner's own
    context first (requests arriving together with one system prompt)."""
    system = prompt(6, 30)
    assert_same(pair, [SeqInput("a", system + prompt(7, 10))])
    for r in pair:
        assert r.sync("b", system + prompt(8, 25)) == prompt(8, 25)  # copies a's first 30 tokens
    assert_same(pair, [SeqInput("b", prompt(8, 25))])
    assert pair[0].stats.plain_prefill_tokens == 40 + 24
    assert_same(pair, cont("a", "b"))


def test_sequences_that_share_a_prompt_forked_in_one_forward_decode_as_on_one_context(pair):
    p = prompt(9, 40)
    assert_same(pair, [SeqInput("a", p), SeqInput("b", p + prompt(10, 15))])  # b: a twin of a, then its tail
    assert_same(pair, cont("a", "b"))


def test_exact_mode_never_splits_the_prefill(gguf):
    r = LlamaCppRunner(gguf, 64 << 20, exact=True, plain_prefill=True, slots=2)
    try:
        r.forward([SeqInput("a", prompt(11, 80))])
        assert r.stats.plain_prefill_tokens == 0 and "plain weights" not in r.describe()
    finally:
        r.close()


def test_auto_times_the_choice_once_and_keeps_it_per_file_and_machine(gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("CALID_HOME", str(tmp_path))
    said = []
    first = prefill_weights(gguf, "auto", 2, "cpu-a", said.append)
    kept = read_verdicts(tmp_path / "calibration" / VERDICTS)
    (verdict,) = kept.values()
    assert verdict["plain"] == first and verdict["repacked_ms"] > 0 and verdict["plain_ms"] > 0
    assert "repacked_ms" not in said[0] and "ms repacked" in said[0]
    import calid.runtime.prefill_weights as pp

    monkeypatch.setattr(pp, "time_prefill", lambda *a, **k: pytest.fail("timed again"))
    assert prefill_weights(gguf, "auto", 2, "cpu-a") == first  # read back, not timed
    assert prefill_weights(gguf, "plain", 2, "cpu-a") is True and prefill_weights(gguf, "repacked", 2, "x") is False


def test_an_unknown_choice_is_refused_in_one_line():
    with pytest.raises(PrefillWeightsError, match="unknown prefill_weights 'fast'.*auto, repacked, plain"):
        check_choice("fast")
    assert CHOICES == ("auto", "repacked", "plain")


def test_the_app_config_refuses_an_unknown_choice():
    from serve_app.cluster.config import AppConfig

    with pytest.raises(ValueError, match="prefill_weights must be one of auto, repacked, plain"):
        AppConfig(prefill_weights="fast")
