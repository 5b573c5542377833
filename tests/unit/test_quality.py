import pytest

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


# ---- calid bench quality: grading, the resumable store, the summary -------------------------------------

def test_math_answers_are_the_last_number():
    from calid.bench.quality_curve import Item, last_number, solved

    assert last_number("3 apples and 4 pears make 7.\nAnswer: 1,234") == 1234.0
    assert last_number("no digits") is None
    item = Item("math", "math/0", "q", 16, 9.0)
    assert solved(item, "7 + 2 = 9\nAnswer: 9") and not solved(item, "Answer: 8") and not solved(item, "nine")
    assert solved(Item("mtbench", "mtbench/0", "q", 16), "anything") is None


def test_the_store_resumes_and_refuses_other_settings(tmp_path):
    from calid.bench.quality_curve import Store
    from calid.errors import CalidError

    s = Store(tmp_path, {"max_new_tokens": 8}, fresh=False)
    s.add({"config": "ar", "key": "math/0", "output_ids": [1, 2]})
    with open(s.path, "a") as f:
        f.write('{"config": "ar", "key": "math/1", "outp')  # a line cut short by a stopped run
    again = Store(tmp_path, {"max_new_tokens": 8}, fresh=False)
    assert again.get("ar", "math/0")["output_ids"] == [1, 2] and again.get("ar", "math/1") is None
    with pytest.raises(CalidError, match="--fresh"):
        Store(tmp_path, {"max_new_tokens": 16}, fresh=False)
    assert Store(tmp_path, {"max_new_tokens": 16}, fresh=True).get("ar", "math/0") is None


def test_the_summary_and_the_operating_point(tmp_path):
    from calid.bench.quality_curve import Item, Store, operating_point, summarize
    from calid.decoding.modes import DecodeParams

    work = [Item("humaneval", f"humaneval/{i}", "p", 8, None, i % 2 == 1) for i in range(4)]
    s = Store(tmp_path, {}, fresh=True)
    ar_out = [5, 6, 7, 8]
    for i, it in enumerate(work):
        s.add({"config": "ar", "key": it.key, "output_ids": ar_out, "draft_tokens": 0, "solved": i < 3,
               "match": 4, "nll_sum": 2.0})
        s.add({"config": "filter t=0.8", "key": it.key, "output_ids": [5, 6, 9, 9], "draft_tokens": 2,
               "solved": i < 3, "match": 3, "nll_sum": 4.0})
        s.add({"config": "draft only", "key": it.key, "output_ids": [1, 1, 1, 1], "draft_tokens": 4,
               "solved": False, "match": 1, "nll_sum": 12.0})
    cfgs = [("ar", DecodeParams(mode="ar")), ("filter t=0.8", DecodeParams(mode="filter", threshold=0.8)),
            ("draft only", DecodeParams(mode="filter", threshold=0.0))]
    rows = {(r["config"], r["task"]): r for r in summarize(cfgs, work, s)}
    f = rows[("filter t=0.8", "humaneval")]
    assert f["quality"] == 0.75 and f["filtered_fraction"] == 0.5 and f["token_match"] == 0.75
    assert f["prefix_agreement"] == 0.5 and f["target_nll"] == 1.0 and f["done"] == "4/4"
    assert operating_point(list(rows.values()))["config"] == "filter t=0.8"  # draft only loses 75 points
