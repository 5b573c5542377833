"""A real Q4_0 copy of SmolLM2's GGUF: made once with llama.cpp's quantizer, the same model, and a draft."""
from __future__ import annotations

import pytest

from calid.backends import BackendError, cpu_identity, gguf_file, open_draft, open_model
from calid.decoding.modes import DecodeParams
from calid.engine import Engine
from calid.generation import GenerationRequest, SamplingParams
from calid.models import draft_weights as dw
from calid.models.presets import TEST_MODEL
from calid.runtime.llamacpp import LlamaCppRunner
from calid.runtime.runner import SeqInput
from calid.text import encode_prompt
from calid.verdicts import read_verdicts

pytestmark = pytest.mark.model
QUIET = dict(log=lambda line: None, show_progress=False)


@pytest.fixture(scope="module")
def shipped():
    return gguf_file(TEST_MODEL, show_progress=False)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CALID_HOME", str(tmp_path))
    return tmp_path


def test_the_copy_is_the_same_model_in_q4_0(shipped, home):
    copy = dw.make_q4_0(shipped, 2)
    assert copy.parent == home / "gguf" and copy.stat().st_size < shipped.stat().st_size
    assert dw.make_q4_0(shipped, 2) == copy  # made once
    assert not list(copy.parent.glob("*.part"))
    a = LlamaCppRunner(shipped, kv_budget_bytes=64 << 20, slots=2, exact=False)
    b = LlamaCppRunner(copy, kv_budget_bytes=64 << 20, slots=2, exact=False)
    tok = open_model(TEST_MODEL, backend="llamacpp", **QUIET).tokenizer
    ids = tok.encode(
        "def is_prime(n):\n    if n < 2:\n        return False\n    for i in range(2, int(n ** 0.5) + 1):\n"
        "        if n % i == 0:\n            return False\n    return True\n"
    )
    rows = [r.forward([SeqInput("s", ids, logits_at=list(range(len(ids))))])[0] for r in (a, b)]
    a.close(), b.close()
    agree = (rows[0].argmax(-1) == rows[1].argmax(-1)).float().mean().item()
    assert rows[0].shape == rows[1].shape and agree >= 0.8, agree


def test_auto_times_both_files_and_serves_a_draft_that_proves_ar(shipped, home):
    said = []
    chosen = dw.draft_weights(shipped, "auto", 2, cpu_identity(), said.append)
    verdict = read_verdicts(home / "calibration" / dw.VERDICTS)
    (v,) = verdict.values()
    assert set(v["shipped_ms"]) == set(v["q4_0_ms"]) == {"1", "4"}
    assert chosen == (dw.q4_0_path(shipped) if v["q4_0"] else shipped) and "draft weights" in said[0]
    target = open_model(TEST_MODEL, backend="llamacpp", **QUIET)
    draft = open_draft(TEST_MODEL, target, backend="llamacpp", weights="q4_0", **QUIET)
    assert draft.runner.path == dw.q4_0_path(shipped)
    assert target.runner.path.name == shipped.name  # a target reads its GGUF as shipped, a copy on disk or not
    engine = Engine(target.runner, target.tokenizer, target.eos_ids, draft=draft.runner, max_batch=2)
    ids = encode_prompt(target.tokenizer, "Write a Python function that checks whether a number is prime.")
    out = {m: engine.generate([GenerationRequest(list(ids), SamplingParams(max_new_tokens=24),
                                                 decode=DecodeParams(mode=m))])[0].output_ids
           for m in ("ar", "speculative")}
    assert out["speculative"] == out["ar"]  # lossless whatever the draft's weights


def test_a_torch_draft_has_no_q4_0_copy(smol):
    with pytest.raises(BackendError, match="draft_weights q4_0 applies to llama.cpp models"):
        open_draft(TEST_MODEL, TEST_MODEL, backend="torch", dtype="fp32", weights="q4_0", **QUIET)
    with pytest.raises(BackendError, match="self:2 runs on torch"):
        open_draft("self:2", TEST_MODEL, dtype="fp32", weights="q4_0", **QUIET)
