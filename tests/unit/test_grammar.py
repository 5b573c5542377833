"""Structured output's pure parts (calid.decoding.grammar): compiling a grammar refuses bad ones by name, and
the cursor's common-prefix search. Masks on real tokenizers and every decoding mode: tests/engine."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from calid.decoding.grammar import Grammar, _common_prefix
from calid.errors import InvalidRequestError
from calid.generation import SamplingParams


@pytest.mark.parametrize("kind,source,words", [
    ("xml", "<a/>", "kind must be one of"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
    ("json_schema", json.dumps({"type": "frob"}), "frob"),
    ("regex", "a(b", "unclosed group"),
    ("regex", "", "regex is empty"),
    ("lark", "start: foo", 'unknown name: "foo"'),
    ("lark", "x" * 100_001, "over the limit"),
])
def test_a_bad_grammar_is_refused_naming_the_problem(kind, source, words):
    with pytest.raises(InvalidRequestError, match=words):
        Grammar.compile(kind, source)


def test_good_grammars_compile_and_compare_by_content():
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})
    a, b = Grammar.compile("json_schema", schema), Grammar.compile("json_schema", schema)
    assert a == b and hash(a) == hash(b) and a.spec
    assert Grammar.compile("json_object").spec != a.spec
    assert Grammar.compile("regex", "[a-z]+").kind == "regex"
    assert Grammar.compile("lark", 'start: "yes" | "no"').source == 'start: "yes" | "no"'


def test_ignore_eos_with_a_grammar_is_refused():
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, grammar=Grammar.compile("regex", "a")).validate()


@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12))
def test_common_prefix_is_the_longest_shared_start(a, b):
    k = _common_prefix(a, b)
    assert a[:k] == b[:k]
    assert k == min(len(a), len(b)) or a[k] != b[k]
