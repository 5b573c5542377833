import pytest

from calid.cli import main
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
    argv = ["generate", "--model", TEST_MODEL, "--mode", "lookahead", "--max-new-tokens", "12", "Say hello twice."]
    assert main(argv) == 0
    assert loaded == [TEST_MODEL]  # the target only
    assert "lookahead" in capsys.readouterr().err
