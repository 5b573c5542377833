"""Backend and dtype selection: the rules, and clear refusals of what cannot work."""
import pytest

from calid import backends
from calid.backends import BackendError, pick_backend, pick_dtype


def test_auto_runs_gguf_models_on_llamacpp_on_cpu_and_torch_elsewhere(monkeypatch):
    monkeypatch.setattr(backends, "llamacpp_available", lambda: True)
    assert pick_backend("auto", "smollm2-135m-instruct")[0] == "llamacpp"
    assert pick_backend("auto", "/models/x.gguf")[0] == "llamacpp"
    assert pick_backend("auto", "smollm2-135m-instruct", device="cuda")[0] == "torch"
    assert pick_backend("auto", "smollm2-135m-instruct", sharded=True)[0] == "torch"
    assert pick_backend("auto", "/models/hf-folder")[0] == "torch"
    assert pick_backend("auto", "self:10")[0] == "torch"


def test_auto_says_why_it_falls_back_when_llamacpp_is_missing(monkeypatch):
    monkeypatch.setattr(backends, "llamacpp_available", lambda: False)
    chosen, why = pick_backend("auto", "smollm2-135m-instruct")
    assert chosen == "torch" and "not installed" in why
    with pytest.raises(BackendError, match="not installed"):
        pick_backend("llamacpp", "smollm2-135m-instruct")


@pytest.mark.parametrize("spec, device, sharded, message", [
    ("smollm2-135m-instruct", "cuda", False, "runs on CPU"),
    ("smollm2-135m-instruct", "cpu", True, "parallel groups run on torch"),
    ("/models/hf-folder", "cpu", False, "not a GGUF model"),
])
def test_explicit_llamacpp_refuses_what_it_cannot_run(monkeypatch, spec, device, sharded, message):
    monkeypatch.setattr(backends, "llamacpp_available", lambda: True)
    with pytest.raises(BackendError, match=message):
        pick_backend("llamacpp", spec, device, sharded)


def test_unknown_names_are_refused():
    with pytest.raises(BackendError, match="unknown backend 'onnx'"):
        pick_backend("onnx", "smollm2-135m-instruct")
    with pytest.raises(BackendError, match="unknown dtype 'fp8'"):
        pick_dtype("fp8", "cpu")


def test_dtype_auto_follows_the_cpu(monkeypatch):
    monkeypatch.setattr(backends, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert pick_dtype("auto", "cpu") == "bf16"
    monkeypatch.setattr(backends, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert pick_dtype("auto", "cpu") == "fp32"
    assert pick_dtype("auto", "cuda") == "bf16"
    assert pick_dtype("fp32", "cuda") == "fp32"
    assert "avx2" in backends.cpu_summary() and "avx512_bf16" not in backends.cpu_summary()
    monkeypatch.setattr(backends, "_cpuinfo", lambda: {"model name": "AMD EPYC", "cpu family": "25", "model": "1"})
    assert backends.cpu_summary().startswith("AMD EPYC (family 25 model 1), ")
