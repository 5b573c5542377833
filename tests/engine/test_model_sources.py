"""Model sources on real files: a local .gguf file and a local HF folder."""
import pytest

from calid.models.fetch import gguf_path
from calid.models.loader import load_model
from calid.models.presets import PRESETS, TEST_MODEL
from calid.models.source import resolve
from calid.runtime.runner import ModelRunner, SeqInput

pytestmark = pytest.mark.model


def test_local_gguf_converts_once_and_loads_the_same_model(smol, tmp_path, monkeypatch):
    gguf = gguf_path(PRESETS[TEST_MODEL])  # fetched by the smol fixture
    monkeypatch.setenv("CALID_HOME", str(tmp_path))
    source = resolve(str(gguf), show_progress=False)
    assert source.kind == "gguf" and str(source.path).startswith(str(tmp_path))
    assert resolve(str(gguf), show_progress=False).path == source.path  # cached: no second conversion
    lm = load_model(source, show_progress=False)
    ids = [1, 504, 3458, 314]
    a = ModelRunner(lm.model).forward([SeqInput("x", ids)])[0]
    b = ModelRunner(smol.model).forward([SeqInput("x", ids)])[0]
    assert (a - b).abs().max().item() == 0.0


def test_local_hf_folder_is_used_as_is(smol):
    source = resolve(str(smol.path))
    assert source.kind == "dir" and source.path == smol.path
