"""OpenAI JSON <-> calid.v1.GenerateRequest, errors and reply shapes (serve_app.ingress.openai_wire), by hand."""
from __future__ import annotations

import json

import grpc
import pytest

from calid.generation import DecodeStats, GenerationResult
from calid.v1 import calid_pb2 as pb
from serve_app.ingress import openai_wire as wire
from serve_app.ingress.outputs import Output

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_fields_translate_to_the_proto():
    msg, opts = wire.chat_request({**CHAT, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3,
                                   "stop": "\n", "mode": "filter", "threshold": 0.7, "gamma": 4, "top_k": 5,
                                   "ignore_eos": True, "user": "u", "metadata": {"a": 1}, "presence_penalty": 0,
                                   "frobnicate": [1, 2], "logit_bias": None, "n": 1, "stream": True,
                                   "stream_options": {"include_usage": True}})
    assert (msg.model, msg.max_new_tokens, msg.seed, list(msg.stop), msg.mode, msg.gamma, msg.top_k) == \
        ("m", 7, 3, ["\n"], "filter", 4, 5)
    assert msg.temperature == pytest.approx(0.5) and msg.threshold == pytest.approx(0.7) and msg.ignore_eos
    assert opts.stream and opts.include_usage and opts.logprobs is None
    assert [(m.role, m.content) for m in msg.messages] == [("user", "hi")]
    msg, _ = wire.chat_request({**CHAT, "mode": "rollback", "rollback_nll": 3})
    assert msg.mode == "rollback" and msg.rollback_nll == pytest.approx(3.0)
    msg, _ = wire.chat_request({**CHAT, "max_quality_loss": 2})
    assert msg.HasField("max_quality_loss") and msg.max_quality_loss == pytest.approx(2.0)


def test_chat_defaults_and_precedence():
    msg, opts = wire.chat_request({**CHAT, "max_tokens": 5, "max_completion_tokens": 9, "temperature": None})
    assert msg.max_new_tokens == 9 and not msg.HasField("temperature") and not opts.stream
    msg, _ = wire.chat_request(CHAT)
    assert not msg.HasField("max_new_tokens")  # the server's default
    msg, _ = wire.chat_request({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                             {"type": "text", "text": "b"}]},
                                             {"role": "assistant", "content": None}]})
    assert [(m.role, m.content) for m in msg.messages] == [("system", "ab"), ("assistant", "")]
    msg, opts = wire.chat_request({**CHAT, "logprobs": True, "top_logprobs": 3})
    assert msg.logprobs == 3 and opts.logprobs == 3


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": 1.5}, "n"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "grammar": "start: /b/"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": "12"}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop": [1]}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"model": 3}, "model"),
    ],
)
def test_bad_chat_fields_are_400_naming_the_field(extra, param):
    with pytest.raises(wire.WireError) as e:
        wire.chat_request({**CHAT, **extra})
    assert e.value.status == 400 and e.value.param == param and e.value.body()["error"]["param"] == param


def test_n_choices_are_n_requests_per_prompt_each_with_its_own_seed():
    msg, opts = wire.chat_request({**CHAT, "n": 3, "seed": 2**64 - 2, "temperature": 0.8})
    out = wire.choices([msg], opts.n)
    assert opts.n == 3 and len(out) == 3 and [m.seed for m in out] == [2**64 - 2, 2**64 - 1, 0]
    assert all(m.messages == msg.messages and m.temperature == msg.temperature for m in out)
    unseeded, opts = wire.chat_request({**CHAT, "n": 2})
    assert not any(m.HasField("seed") for m in wire.choices([unseeded], opts.n))  # each samples on its own
    msgs, opts = wire.completion_requests({"model": "m", "prompt": ["a", "b"], "n": 2})
    assert [m.prompt for m in wire.choices(msgs, opts.n)] == ["a", "a", "b", "b"]  # choice p * n + j
    msgs, opts = wire.completion_requests({"model": "m", "prompt": ["a"] * 5, "n": 16})
    with pytest.raises(wire.WireError, match="prompts x n is at most 64") as e:
        wire.choices(msgs, opts.n)
    assert e.value.param == "n"


def test_completion_prompts_of_every_shape():
    for prompt, want in (("a", [("a", [])]), (["a", "b"], [("a", []), ("b", [])]), ([1, 2], [("", [1, 2])]),
                         ([[1], [2, 3]], [("", [1]), ("", [2, 3])])):
        msgs, _ = wire.completion_requests({"prompt": prompt})
        assert [(m.prompt, list(m.prompt_token_ids)) for m in msgs] == want
        assert all(m.raw_prompt and m.max_new_tokens == 16 for m in msgs)  # OpenAI's completions default
    msgs, opts = wire.completion_requests({"prompt": [5, 6], "max_tokens": 0, "echo": True, "logprobs": 1})
    assert msgs[0].echo and msgs[0].logprobs == 1 and msgs[0].max_new_tokens == 0 and opts.echo
    for bad in (None, "", [], [[]], [1, "a"], [True], [[1], "a", 2], [-1], ["x"] * 65):
        with pytest.raises(wire.WireError) as e:
            wire.completion_requests({"prompt": bad} if bad != "" else {"prompt": []})
        assert e.value.param == "prompt"


@pytest.mark.parametrize("raw", [b"\xff\xfe{}", b'{"model": "m", "messages": [', b"[1, 2]", b'{"a": NaN}',
                                 b'{"a": Infinity}', b"", b"[" * 100000])
def test_bodies_that_are_not_json_objects_are_400(raw):
    with pytest.raises(wire.WireError) as e:
        wire.parse_json(raw)
    assert e.value.status == 400


def test_path_refusals_map_to_http_statuses():
    e = wire.from_status(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be at most 4096, got 5000")
    assert (e.status, e.param, e.message) == (400, "max_tokens", "max_tokens must be at most 4096, got 5000")
    assert wire.from_status(grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1], got 0.0").param == "top_p"
    assert wire.from_status(grpc.StatusCode.INVALID_ARGUMENT, "prompt is 9 tokens, over ...").param == "prompt"
    assert wire.from_status(grpc.StatusCode.INVALID_ARGUMENT, "request is 9 bytes").param is None
    for code, status in ((grpc.StatusCode.UNAUTHENTICATED, 401), (grpc.StatusCode.NOT_FOUND, 404),
                         (grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503),
                         (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 500)):
        assert wire.from_status(code, "x").status == status
    assert wire.from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", 1.0).retry_after_s == 1.0


def _lp(token, logprob, *top):
    return pb.TokenLogprob(token_id=token, logprob=logprob, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])


def _result(output_ids, finish="length", prompt_tokens=3):
    return GenerationResult(
        "r", prompt_tokens, output_ids, "", finish, 0.1, 0.2, DecodeStats(target_tokens=len(output_ids))
    )


def _decode(ids):
    return "".join(f"<{i}>" for i in ids)


def test_completion_reply_with_echo_and_logprobs():
    _, opts = wire.completion_requests({"prompt": [1, 2, 3], "max_tokens": 1, "echo": True, "logprobs": 1})
    out = Output(text="<9>", token_ids=[9], logprobs=[_lp(9, -0.5, (9, -0.5))], result=_result([9]),
                 prompt_ids=[1, 2, 3], prompt_logprobs=[_lp(2, -1.0, (4, -0.25)), _lp(3, -2.0, (3, -2.0))])
    obj = wire.Reply("completion", opts, "served", _decode, ["ar"]).whole([out])
    choice = obj["choices"][0]
    assert obj["model"] == "served" and obj["object"] == "text_completion"
    assert choice["text"] == "<1><2><3><9>" and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["<1>", "<2>", "<3>", "<9>"] and lp["token_logprobs"] == [None, -1.0, -2.0, -0.5]
    assert lp["top_logprobs"] == [None, {"<4>": -0.25}, {"<3>": -2.0}, {"<9>": -0.5}]
    assert lp["text_offset"] == [0, 3, 6, 9]
    assert obj["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    assert obj["calid"]["mode"] == "ar" and obj["calid"]["output_tokens"] == 1


def test_n_choices_reply_counts_each_prompt_once():
    _, opts = wire.chat_request({**CHAT, "n": 2})
    outs = [Output(text=f"<{t}>", token_ids=[t], logprobs=[], result=_result([t], prompt_tokens=5)) for t in (7, 8)]
    obj = wire.Reply("chat", opts, "served", _decode, ["ar", "ar"]).whole(outs)
    assert [(c["index"], c["message"]["content"]) for c in obj["choices"]] == [(0, "<7>"), (1, "<8>")]
    assert obj["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


def test_chat_stream_chunks_and_usage():
    _, opts = wire.chat_request({**CHAT, "stream": True, "stream_options": {"include_usage": True},
                                 "logprobs": True, "top_logprobs": 1})
    reply = wire.Reply("chat", opts, "served", _decode, ["speculative"])
    first = reply.chunk(0, Output(text="<5>", token_ids=[5], logprobs=[_lp(5, -0.125, (5, -0.125))]), first=True)
    last = reply.chunk(0, Output(text="", token_ids=[2], logprobs=[_lp(2, -0.375, (2, -0.375))],
                                 result=_result([5, 2], "eos")), first=False)
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "<5>"}
    assert first["choices"][0]["logprobs"]["content"][0] == {
        "token": "<5>", "logprob": -0.125, "bytes": list(b"<5>"),
        "top_logprobs": [{"token": "<5>", "logprob": -0.125, "bytes": list(b"<5>")}]}
    assert last["choices"][0]["finish_reason"] == "stop" and last["choices"][0]["delta"] == {}
    assert last["calid"]["mode"] == "speculative"
    usage = reply.usage_chunk(3, 2)
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5
    assert wire.sse(usage).startswith("data: {") and wire.sse(usage).endswith("}\n\n")
    assert json.loads(wire.sse(usage)[6:]) == usage


def test_response_formats_and_structured_outputs_become_the_request_grammar():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    msg, _ = wire.chat_request({**CHAT, "response_format": {"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": schema,
                                                                            "strict": True}}})
    assert json.loads(msg.grammar.json_schema) == schema
    msg, _ = wire.chat_request({**CHAT, "response_format": {"type": "json_object"}})
    assert msg.grammar.WhichOneof("kind") == "json_object" and msg.grammar.json_object
    msg, _ = wire.chat_request({**CHAT, "response_format": {"type": "text"}})
    assert not msg.HasField("grammar")
    msg, _ = wire.chat_request({**CHAT, "structured_outputs": {"json": schema}})
    assert json.loads(msg.grammar.json_schema) == schema
    msgs, _ = wire.completion_requests({"prompt": ["a", "b"], "structured_outputs": {"regex": "[0-9]{3}"}})
    assert [m.grammar.regex for m in msgs] == ["[0-9]{3}"] * 2
    msg, _ = wire.chat_request({**CHAT, "structured_outputs": {"grammar": 'start: "yes" | "no"'}})
    assert msg.grammar.lark == 'start: "yes" | "no"'


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                              "parameters": CITY}}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _out(text: str, finish: str | None = "eos"):
    result = None if finish is None else GenerationResult("r", 3, [1, 2], text, finish, 0.1, 0.2, DecodeStats())
    return Output(text, [1, 2], [], result)


def test_tools_and_tool_choice_reach_the_request_and_the_reply_returns_calls():
    msg, opts = wire.chat_request({**CHAT, "tools": WEATHER, "tool_choice": "required"})
    assert json.loads(msg.tools) == WEATHER and msg.tool_choice == "required"
    assert opts.tool_names == {"get_weather"}
    msg, _ = wire.chat_request({**CHAT, "tools": WEATHER,
                                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert msg.tool_choice == "get_weather"
    msg, _ = wire.chat_request({**CHAT, "tools": WEATHER, "tool_choice": "required", "parallel_tool_calls": False})
    assert msg.HasField("parallel_tool_calls") and not msg.parallel_tool_calls
    msg, opts = wire.chat_request({**CHAT, "tools": WEATHER, "tool_choice": "none"})
    assert not opts.tool_names
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    msg, _ = wire.chat_request({**CHAT, "messages": history, "tools": WEATHER})
    assert [m.role for m in msg.messages] == ["user", "assistant", "tool"]
    assert json.loads(msg.messages[1].tool_calls)[0]["id"] == "c1" and msg.messages[2].tool_call_id == "c1"

    _, opts = wire.chat_request({**CHAT, "tools": WEATHER})
    reply = wire.Reply("chat", opts, "m", lambda ids: "", ["ar"])
    choice = reply.whole([_out(CALL_TEXT)])["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'} and call["type"] == "function"
    assert reply.whole([_out("It is sunny.")])["choices"][0]["message"] == {"role": "assistant",
                                                                            "content": "It is sunny."}


def test_streamed_calls_are_held_back_and_sent_whole_and_plain_text_flows():
    _, opts = wire.chat_request({**CHAT, "tools": WEATHER})
    reply = wire.Reply("chat", opts, "m", lambda ids: "", ["ar"])
    parts = [reply.chunk(0, _out(t, None), i == 0)["choices"][0] for i, t in enumerate(["<tool", "_call>\n{"])]
    assert all("content" not in p["delta"] or not p["delta"]["content"] for p in parts)
    last = reply.chunk(0, _out(CALL_TEXT[len("<tool_call>\n{"):]), False)["choices"][0]
    assert last["finish_reason"] == "tool_calls" and last["delta"]["tool_calls"][0]["index"] == 0
    assert json.loads(last["delta"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    reply = wire.Reply("chat", opts, "m", lambda ids: "", ["ar"])
    said = [reply.chunk(0, _out(t, None if t != "." else "eos"), i == 0)["choices"][0]
            for i, t in enumerate(["It", " is sunny", "."])]
    assert "".join(p["delta"].get("content") or "" for p in said) == "It is sunny."
    assert said[0]["delta"]["content"] == "It" and said[-1]["finish_reason"] == "stop"


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": WEATHER, "tool_choice": "get_time"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": WEATHER * 2}, "tools"),
])
def test_bad_tools_are_400_naming_the_field(extra, param):
    with pytest.raises(wire.WireError) as e:
        wire.chat_request({**CHAT, **extra})
    assert e.value.status == 400 and e.value.param == param
