"""The draft's weights choice: its rule, its cached verdict, its errors (llama.cpp is not called here)."""
from __future__ import annotations

import json

import pytest

from calid.models import draft_weights as dw
from serve_app.cluster.config import AppConfig


def test_unknown_choice_is_a_clear_error():
    with pytest.raises(dw.DraftWeightsError, match="unknown draft_weights 'q5'.*auto, as-is, q4_0"):
        dw.check_choice("q5")
    with pytest.raises(ValueError, match="draft_weights must be one of auto, as-is, q4_0"):
        AppConfig(draft_weights="q5")
    assert AppConfig().draft_weights == "auto"


def test_the_copy_must_be_faster_by_a_margin_at_every_size():
    shipped = {1: 50.0, 4: 100.0}
    assert dw.faster(shipped, {1: 35.0, 4: 60.0})
    assert not dw.faster(shipped, {1: 35.0, 4: 97.0})  # 3% at four rows: noise, not a reason to requantize
    assert not dw.faster(shipped, {1: 52.0, 4: 60.0})  # slower alone


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("CALID_HOME", str(tmp_path / "home"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def _fake_copy(gguf_path, threads):
    out = dw.q4_0_path(gguf_path)
    out.write_bytes(b"copy")
    return out


def test_auto_times_once_and_keeps_the_verdict(gguf, monkeypatch):
    calls, said = [], []
    monkeypatch.setattr(dw, "make_q4_0", _fake_copy)

    def timed(paths, threads):
        calls.append(paths)
        return [{1: 50.0, 4: 100.0}, {1: 30.0, 4: 55.0}]

    monkeypatch.setattr(dw, "step_ms", timed)
    first = dw.draft_weights(gguf, "auto", 2, "cpu A", said.append)
    assert first == dw.q4_0_path(gguf) and len(calls) == 1
    assert "a Q4_0 copy of model.gguf" in said[0] and "4 rows 100.0 -> 55.0 ms" in said[0]
    assert dw.draft_weights(gguf, "auto", 2, "cpu A", said.append) == first
    assert len(calls) == 1  # the verdict came from disk
    kept = json.loads((dw.cache_dir("calibration") / dw.VERDICTS).read_text())
    assert [v["q4_0"] for v in kept.values()] == [True]
    dw.draft_weights(gguf, "auto", 2, "cpu B", said.append)  # another machine (or thread count): timed again
    assert len(calls) == 2


def test_auto_keeps_the_shipped_file_when_the_copy_does_not_pay(gguf, monkeypatch):
    monkeypatch.setattr(dw, "make_q4_0", _fake_copy)
    monkeypatch.setattr(dw, "step_ms", lambda paths, threads: [{1: 50.0, 4: 100.0}, {1: 49.0, 4: 98.0}])
    said = []
    assert dw.draft_weights(gguf, "auto", 2, "cpu A", said.append) == gguf
    assert "as shipped (a Q4_0 copy is not 5% faster here" in said[0]


def test_auto_falls_back_to_the_shipped_file_when_no_copy_can_be_made(gguf, monkeypatch):
    def broken(path, threads):
        raise dw.DraftWeightsError("llama.cpp could not quantize model.gguf to Q4_0 (code 1)")

    monkeypatch.setattr(dw, "make_q4_0", broken)
    said = []
    assert dw.draft_weights(gguf, "auto", 2, "cpu A", said.append) == gguf
    assert "keeping model.gguf as shipped (llama.cpp could not quantize" in said[0]
    assert dw.draft_weights(gguf, "as-is", 2, "cpu A") == gguf
    with pytest.raises(dw.DraftWeightsError, match="could not quantize"):
        dw.draft_weights(gguf, "q4_0", 2, "cpu A")  # asked for explicitly: an error, not a silent fallback
