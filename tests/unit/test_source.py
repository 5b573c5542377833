import time

import pytest

from calid.errors import ModelSourceError
from calid.models.source import resolve


def test_unknown_spec_names_the_presets(tmp_path):
    with pytest.raises(ModelSourceError, match="unknown model 'nope'.*smollm2-135m-instruct"):
        resolve("nope")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelSourceError, match="without config.json"):
        resolve(str(tmp_path))


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelSourceError, match="GGUF file not found"):
        resolve(str(tmp_path / "missing.gguf"))


def test_hub_id_without_a_hub_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t = time.perf_counter()
    with pytest.raises(ModelSourceError, match="hub id.*no hub here"):
        resolve("Qwen/Qwen2.5-Coder-1.5B-Instruct")
    assert time.perf_counter() - t < 2.0
