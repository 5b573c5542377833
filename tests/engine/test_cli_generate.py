import pytest

from serve_app.main import main
from calid.models.presets import TEST_MODEL

pytestmark = pytest.mark.model


def test_generate_streams_text_and_reports_speed(smol, capsys):
    assert main(["generate", "--model", TEST_MODEL, "--max-new-tokens", "12", "What is 2 + 2?"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "tok/s" in captured.err and "finish:" in captured.err


def test_generate_speculative_with_self_draft_reports_draft_stats(smol, capsys):
    argv = ["generate", "--model", TEST_MODEL, "--mode", "speculative", "--draft", "self:10", "--max-new-tokens", "12",
            "Name a prime number."]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "from draft" in err and "mean accepted" in err


def test_bad_self_draft_spec_is_one_line(smol, capsys):
    argv = ["generate", "--model", TEST_MODEL, "--mode", "speculative", "--draft", "self:x", "hi"]
    assert main(argv) == 2
    assert "self:N needs an integer" in capsys.readouterr().err


def test_generate_lookahead_needs_no_draft_model(smol, capsys, monkeypatch):
    import calid.models.loader as loader

    loaded = []
    real = loader.load_model
    monkeypatch.setattr(loader, "load_model", lambda spec, *a, **k: loaded.append(spec) or real(spec, *a, **k))
    argv = ["generate", "--model", TEST_MODEL, "--backend", "torch", "--mode", "lookahead", "--max-new-tokens", "12",
            "Say hello twice."]
    assert main(argv) == 0
    assert loaded == [TEST_MODEL]  # the target only
    assert "lookahead" in capsys.readouterr().err


def test_generate_runs_a_gguf_model_on_llamacpp_by_default_and_says_so(smol, capsys):
    assert main(["generate", "--model", TEST_MODEL, "--max-new-tokens", "8", "--raw", "def add(a, b):"]) == 0
    err = capsys.readouterr().err
    assert f"{TEST_MODEL}: llama.cpp (auto: GGUF model on CPU)" in err and "tok/s" in err


def test_a_self_draft_on_llamacpp_is_refused_in_one_line(smol, capsys):
    argv = ["generate", "--model", TEST_MODEL, "--backend", "llamacpp", "--mode", "speculative", "--draft", "self:10",
            "hi"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("calid: error: a self-draft (self:N) runs on torch: llama.cpp cannot run a subset of a "
                       "model's layers")


def test_a_torch_self_draft_beside_a_llamacpp_target(smol, capsys):
    argv = [
        "generate",
        "--model",
        TEST_MODEL,
        "--mode",
        "speculative",
        "--draft",
        "self:10",
        "--draft-backend",
        "torch",
        "--max-new-tokens",
        "12",
        "Name a prime number.",
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "llama.cpp" in err and "self:10 of" in err and "mean accepted" in err
