"""CLI errors: one line on stderr, exit code 2, before any model is loaded."""
import time

import pytest

from serve_app.main import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", ""], "prompt is empty"),
        (["generate", "hi", "--temperature", "-1"], "temperature must be >= 0"),
        (["generate", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["generate", "hi", "--top-p", "1.01"], "top_p must be in (0, 1]"),
        (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1"),
        (["models", "pull", "gpt-17"], "unknown preset 'gpt-17'"),
        (["generate", "hi", "--model", "/no/such/model.gguf"], "GGUF file not found"),
        (["bench", "modes", "--workloads", "poetry"], "--workloads among mix, humaneval, grounded, chat"),
        (["bench", "modes", "--concurrency", "0"], "--concurrency takes counts >= 1"),
        (["bench", "modes", "--plain-run-ms", "-5"], "--plain-run-ms takes milliseconds >= 0"),
        (["bench", "modes", "--max-new-tokens", "1"], "--max-new-tokens >= 2"),
        (["bench", "peers", "--peers", "vllm"], "--peers among llama-cpp-python, llama-server"),
        (["bench", "peers", "--plain-run-ms", "-1"], "--plain-run-ms takes milliseconds >= 0"),
        (["bench", "peers", "--rounds", "0"], "--rounds takes a count >= 1"),
        (["bench", "peers", "--llama-configs", "plain,eagle"], "unknown llama-server configuration 'eagle'"),
        (["bench", "pareto", "--concurrency", "0"], "--concurrency takes counts >= 1"),
        (["bench", "pareto", "--only", "filter t=0.33"], "--only: unknown configuration"),
        (
            ["generate", "hi", "--min-agreement", "0.9", "--threshold", "0.5"],
            "set one of --threshold, --min-agreement and --max-quality-loss",
        ),
        (["generate", "hi", "--min-agreement", "1.5"], "min_agreement must be in (0, 1]"),
        (["generate", "hi", "--max-quality-loss", "200"], "points of task quality in [0, 100]"),
        (["generate", "hi", "--max-quality-loss", "2", "--mode", "tree"], "a budget for --mode filter, not tree"),
        (["generate", "hi", "--mode", "speculative", "--min-agreement", "0.9"], "a budget for mode filter"),
        (["bench", "quality", "--batch", "0"], "--batch and --max-new-tokens must be >= 1"),
        (["bench", "quality", "--only", "filter t=0.33"], "--only: unknown configuration"),
        (["bench", "quality", "--budgets", "0.9,2"], "min_agreement must be in (0, 1]"),
        (["serve", "--models", "a=+self:4"], "--models: 'a=+self:4' names no target model"),
        (["serve", "--models", "a=smollm2-135m-instruct,a=smollm2-135m-instruct"], "names must be unique"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    t = time.perf_counter()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("calid: error: ") and message in err and err.count("\n") == 1
    assert time.perf_counter() - t < 5


def test_models_list_shows_presets(capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"):
        assert name in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "hi", "--mode", "filter", "--threshold", "2"], "threshold must be a probability"),
        (["generate", "hi", "--mode", "speculative", "--gamma", "0"], "gamma must be an integer in [1, 64]"),
    ],
)
def test_bad_decode_flags(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_tree_width(capsys):
    assert main(["generate", "hi", "--mode", "tree", "--tree-width", "0"]) == 2
    assert "tree_width must be an integer in [1, 16]" in capsys.readouterr().err


def test_client_without_a_server_is_one_line(capsys):
    from serve_app.main import main

    assert main(["client", "hi", "--address", "127.0.0.1:9", "--timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("calid: error: no calid server answers at 127.0.0.1:9 (start one with: calid serve)")
    assert err.count("\n") == 1


def test_a_peer_that_cannot_run_says_why():
    from serve_app.bench.peer_servers import PeerServer, PeerUnavailable

    with pytest.raises(PeerUnavailable, match="no llama-server binary"):
        PeerServer("llama-server", "/x.gguf", 2, 8093, 4, None, "m")
