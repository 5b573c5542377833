"""Tool calls' pure parts (calid.tool_calls): tool definitions checked by name, the calls' grammar, and reading
calls back out of the text. The template and real models: tests/serve/test_structured_output_serving.py."""
from __future__ import annotations

import json

import pytest

from calid import tool_calls as tc
from calid.errors import InvalidRequestError

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "description": "now"}}]


class _Tokenizer:  # no added token for the tags: they are matched as text
    def get_added_vocab(self):
        return {"<|im_end|>": 2}


@pytest.mark.parametrize("tools,words", [
    ([], "list of 1 to"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools\\[0\\]"),
    ([{"type": "retrieval"}], "tools\\[0\\]"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "parameters must be"),
    (TOOLS + TOOLS[:1], "given twice"),
])
def test_bad_tools_are_refused_naming_the_entry(tools, words):
    with pytest.raises(InvalidRequestError, match=words):
        tc.check_tools(tools)


def test_choices_and_grammars():
    tools = tc.check_tools(TOOLS)
    assert [tc.check_choice(c, tools) for c in ("auto", "none", "required", "get_time")] == \
        ["auto", "none", "required", "get_time"]
    with pytest.raises(InvalidRequestError, match="tool_choice"):
        tc.check_choice("get_date", tools)
    assert tc.call_grammar(tools, "auto", _Tokenizer()) is None and tc.call_grammar(tools, "none", _Tokenizer()) is None
    several = tc.call_grammar(tools, "required", _Tokenizer())
    one = tc.call_grammar(tools, "required", _Tokenizer(), parallel=False)
    named = tc.call_grammar(tools, "get_weather", _Tokenizer())
    assert "call)*" in several.source and "call)*" not in one.source and "call)*" not in named.source
    assert '"<tool_call>"' in named.source and "get_time" not in named.source and "get_time" in several.source


class _Qwen(_Tokenizer):
    def get_added_vocab(self):
        return {"<tool_call>": 151657, "</tool_call>": 151658}


def test_a_tag_the_tokenizer_has_as_one_token_is_matched_by_its_id():
    g = tc.call_grammar(tc.check_tools(TOOLS), "required", _Qwen())
    assert "<[151657]>" in g.source and "<[151658]>" in g.source


def test_calls_are_read_back_tagged_or_bare_and_anything_else_is_text():
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    names = {"get_weather", "get_time"}
    content, calls = tc.split_calls(f"Let me look.\n<tool_call>\n{call}\n</tool_call>\n<tool_call>\n"
                                    '{"name": "get_time", "arguments": {}}\n</tool_call>', names)
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"} and calls[0]["id"].startswith("call_")
    assert tc.split_calls(call, names)[0] is None and len(tc.split_calls(call, names)[1]) == 1  # no tags
    for text in ("It is sunny.", '{"name": "get_date", "arguments": {}}', "<tool_call>\n{oops}\n</tool_call>",
                 '{"city": "Paris"}'):
        assert tc.split_calls(text, names) == (text, [])
    assert tc.may_be_a_call("<tool") and tc.may_be_a_call("  <tool_call>\n{") and tc.may_be_a_call("{")
    assert not tc.may_be_a_call("It") and not tc.may_be_a_call("<b>")
