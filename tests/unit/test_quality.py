from calid.bench.quality import extract_code, passes_humaneval, prefix_agreement

PROBLEM = {
    "prompt": "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n",
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
}


def test_prefix_agreement():
    assert prefix_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert prefix_agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert prefix_agreement([], [1, 2]) == 0.0


def test_fenced_full_function_passes_and_wrong_one_fails():
    good = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    bad = "```python\ndef add(a, b):\n    return a - b\n```"
    assert passes_humaneval(good, PROBLEM)
    assert not passes_humaneval(bad, PROBLEM)


def test_body_only_completion_is_joined_to_the_prompt():
    assert "def add" in extract_code("    return a + b\n", PROBLEM)
    assert passes_humaneval("    return a + b\n", PROBLEM)


def test_hanging_code_times_out_as_a_failure(monkeypatch):
    import calid.bench.quality as q

    monkeypatch.setattr(q, "EXEC_TIMEOUT_S", 1.0)
    assert not passes_humaneval("```python\ndef add(a, b):\n    while True: pass\n```", PROBLEM)


def test_parse_numbers():
    import pytest

    from calid.bench.report import parse_numbers
    from calid.errors import CalidError

    assert parse_numbers("0.4, 0.7") == [0.4, 0.7]
    assert parse_numbers("8,16", int) == [8, 16]
    with pytest.raises(CalidError, match="comma-separated int"):
        parse_numbers("8,x", int)
