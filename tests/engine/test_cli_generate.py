import pytest

from calid.cli import main
from calid.models.presets import TEST_MODEL

pytestmark = pytest.mark.model


def test_generate_streams_text_and_reports_speed(smol, capsys):
    assert main(["generate", "--model", TEST_MODEL, "--max-new-tokens", "12", "What is 2 + 2?"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "tok/s" in captured.err and "finish:" in captured.err
