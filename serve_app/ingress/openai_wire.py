"""OpenAI's wire format <-> calid's request path, as pure functions (no Ray, no HTTP server).

``chat_request`` / ``completion_requests`` turn a request body into ``calid.v1.GenerateRequest``s (the
front-end-neutral request every front-end hands the router) and the ``Options`` that shape the reply;
``Reply`` builds the JSON objects and SSE chunks of a reply from the router's Outputs; ``WireError``
and ``from_status`` give every refusal OpenAI's error shape and the matching HTTP status.

Fields (docs/openai-api.md has the table): the ones calid serves are translated; the
ones that change nothing here (``user``, ``metadata``, ``store``, null values, unknown names) are ignored,
as the reference servers do; the ones whose meaning calid cannot honour (tools,
non-zero penalties, ``logit_bias``, ``suffix``, ``best_of`` > 1) are refused with a 400 naming the field,
never silently dropped. ``n`` > 1 is served as n requests per prompt (``choices``). ``response_format``
(json_object, json_schema) and ``structured_outputs`` (json, regex, grammar) constrain the output
(calid.decoding.grammar).
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

import grpc
from google.protobuf.json_format import MessageToDict

from calid import tool_calls
from calid.decoding.grammar import Grammar
from calid.errors import InvalidRequestError
from calid.v1 import calid_pb2 as pb
from serve_app.ingress.protocol import MAX_LOGPROBS, stats

U32, U64 = 2**32 - 1, 2**64 - 1
MAX_PROMPTS = 64  # prompts in one completions request (each is one request on the path)
MAX_N = 16  # choices per prompt (each is one request on the path; prompts x n at most MAX_PROMPTS)
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
STATUS = {  # gRPC status of the request path -> HTTP status
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable", 504: "timeout"}
PROTO_NAMES = {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt"}  # in the path's messages
KNOWN_PARAMS = {"prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "mode",
                "threshold", "min_agreement", "max_quality_loss", "rollback_nll", "gamma", "logprobs", "model", "n"}


class WireError(Exception):
    """A refusal in OpenAI's shape: HTTP status, message, the field it is about (``param``)."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after_s = status, message, param, retry_after_s

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error"),
                "param": self.param,
                "code": self.status,
            }
        }


def from_status(code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> WireError:
    """The request path's refusal (a gRPC status) as an OpenAI error; a field named first becomes ``param``."""
    for proto, name in PROTO_NAMES.items():
        message = message.replace(proto, name)
    head = message.split(" ", 1)[0].split("[", 1)[0].strip(":,.")
    return WireError(STATUS.get(code, 500), message, head if head in KNOWN_PARAMS else None, retry_after_s)


def parse_json(raw: bytes) -> dict:
    """A request body as a JSON object; non-UTF-8, malformed JSON, NaN/Infinity or a non-object: 400."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise WireError(400, f"request body is not UTF-8 (byte {e.start})") from None

    def constant(name):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(text, parse_constant=constant)
    except (ValueError, RecursionError) as e:
        raise WireError(400, f"request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise WireError(400, "request body must be a JSON object")
    return body


@dataclass
class Options:
    """What shapes the reply beside the generated tokens."""

    model: str
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # alternatives per token, when logprobs were asked for
    echo: bool = False
    n: int = 1  # choices per prompt: choice p * n + j is prompt p's j-th
    tool_names: frozenset[str] = frozenset()  # chat with tools: the functions whose calls the reply returns


# ---- fields ------------------------------------------------------------------------------------

def _field(body: dict, name: str, kind: str, lo=None, hi=None):
    """``body[name]`` checked for ``kind`` (bool, int, number, str) and range; None when absent or null."""
    v = body.get(name)
    if v is None:
        return None
    ok = {"bool": isinstance(v, bool), "str": isinstance(v, str),
          "int": isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer(),
          "number": isinstance(v, (int, float)) and not isinstance(v, bool)}[kind]
    if not ok:
        raise WireError(400, f"{name} must be {'an' if kind == 'int' else 'a'} "
                        f"{dict(int='integer', number='number', bool='boolean', str='string')[kind]}, "
                        f"got {json.dumps(v)[:40]}", name)
    if kind == "int":
        v = int(v)
    if kind == "number" and not math.isfinite(v):
        raise WireError(400, f"{name} must be a finite number", name)
    if lo is not None and v < lo or hi is not None and v > hi:
        raise WireError(400, f"{name} must be between {lo} and {hi}, got {v}", name)
    return v


def _refuse_unsupported(body: dict) -> None:
    best_of = _field(body, "best_of", "int", 1, U32)
    if best_of not in (None, 1):
        raise WireError(400, "best_of must be 1", "best_of")
    for name in ("functions", "logit_bias", "suffix"):
        if body.get(name):
            raise WireError(400, f"{name} is not supported by calid" + (" (use tools)" if name == "functions" else ""),
                            name)
    for name in ("presence_penalty", "frequency_penalty"):
        if _field(body, name, "number") not in (None, 0):
            raise WireError(400, f"{name} is not supported by calid (only 0)", name)


def _common(body: dict, default_max_tokens: int | None) -> tuple[pb.GenerateRequest, Options]:
    _refuse_unsupported(body)
    model = _field(body, "model", "str") or ""
    msg = pb.GenerateRequest(model=model)
    max_tokens = _field(body, "max_completion_tokens", "int", 0, U32)
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", "int", 0, U32)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None:
        msg.max_new_tokens = max_tokens
    for name, kind, hi in (("temperature", "number", None), ("top_p", "number", None), ("threshold", "number", None),
                           ("min_agreement", "number", None), ("max_quality_loss", "number", None),
                           ("rollback_nll", "number", None),
                           ("top_k", "int", U32), ("gamma", "int", U32), ("seed", "int", U64)):
        v = _field(body, name, kind, 0 if kind == "int" else None, hi)
        if v is not None:
            setattr(msg, name, v)
    for name in ("ignore_eos",):
        v = _field(body, name, "bool")
        if v is not None:
            setattr(msg, name, v)
    mode = _field(body, "mode", "str")
    if mode:
        msg.mode = mode
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise WireError(400, "stop must be a string or a list of strings", "stop")
        msg.stop.extend(s for s in stop if s)
    grammar = _grammar(body)
    if grammar is not None:
        msg.grammar.CopyFrom(grammar)
    stream = bool(_field(body, "stream", "bool"))
    opts = Options(model=model, stream=stream, n=_field(body, "n", "int", 1, MAX_N) or 1)
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise WireError(400, "stream_options must be an object", "stream_options")
        opts.include_usage = stream and bool(_field(so, "include_usage", "bool"))
    return msg, opts


def _tools(body: dict, msg: pb.GenerateRequest, opts: "Options") -> None:
    """``tools`` and ``tool_choice`` onto the request; ``opts.tool_names``: the calls the reply may hold."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise WireError(400, "tool_choice needs tools", "tool_choice")
        return
    try:
        tools = tool_calls.check_tools(tools)
    except InvalidRequestError as e:
        raise WireError(400, str(e), "tools") from None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        choice = choice["function"].get("name")
    try:
        choice = tool_calls.check_choice(choice if choice is not None else "auto", tools)
    except InvalidRequestError as e:
        raise WireError(400, str(e), "tool_choice") from None
    if choice != "auto" and msg.HasField("grammar"):
        raise WireError(400, "response_format and a tool_choice that asks for calls cannot both hold", "tool_choice")
    msg.tools, msg.tool_choice = json.dumps(tools), choice
    parallel = _field(body, "parallel_tool_calls", "bool")
    if parallel is not None:
        msg.parallel_tool_calls = parallel
    if choice != "none":
        opts.tool_names = frozenset(t["function"]["name"] for t in tools)


def _grammar(body: dict) -> pb.Grammar | None:
    """``response_format`` (OpenAI: text, json_object, json_schema) or calid's ``structured_outputs`` (as vLLM
    names it: one of json, regex, grammar (Lark)) as the request's Grammar, compiled here so that a bad one is
    a 400 naming its field."""
    fmt, so = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and so is not None:
        raise WireError(400, "give response_format or structured_outputs, not both", "structured_outputs")
    if fmt is not None:
        param = "response_format"
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise WireError(400, "response_format.type must be text, json_object or json_schema", param)
        if fmt["type"] == "text":
            return None
        if fmt["type"] == "json_object":
            kind, source = "json_object", ""
        else:
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise WireError(400, "response_format.json_schema must be an object with a schema object", param)
            kind, source = "json_schema", json.dumps(spec.get("schema", {}))
    elif so is not None:
        param = "structured_outputs"
        given = [k for k in ("json", "regex", "grammar") if isinstance(so, dict) and so.get(k) is not None]
        if len(given) != 1:
            raise WireError(400, "structured_outputs must have exactly one of json, regex, grammar", param)
        kind = {"json": "json_schema", "regex": "regex", "grammar": "lark"}[given[0]]
        source = so[given[0]]
        if kind == "json_schema" and not isinstance(source, str):
            source = json.dumps(source)
        if not isinstance(source, str):
            raise WireError(400, f"structured_outputs.{given[0]} must be a string", param)
    else:
        return None
    try:
        Grammar.compile(kind, source)
    except InvalidRequestError as e:
        raise WireError(400, f"{param}: {e}", param) from None
    return pb.Grammar(json_object=True) if kind == "json_object" else pb.Grammar(**{kind: source})


def _content(m: dict, i: int) -> str:
    content = m.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise WireError(400, f"messages[{i}].content[{j}]: only text parts are served", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise WireError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")


def choices(msgs: list[pb.GenerateRequest], n: int) -> list[pb.GenerateRequest]:
    """``n`` requests per prompt (choice p * n + j is prompt p's j-th), each sampled on its own: with a seed
    ``s``, choice j gets ``s + j``, so that a seeded request is reproducible and its choices differ."""
    if n == 1:
        return msgs
    if len(msgs) * n > MAX_PROMPTS:
        raise WireError(400, f"prompts x n is at most {MAX_PROMPTS}, got {len(msgs)} x {n}", "n")
    out = []
    for msg in msgs:
        for j in range(n):
            m = pb.GenerateRequest()
            m.CopyFrom(msg)
            if msg.HasField("seed"):
                m.seed = (msg.seed + j) % (U64 + 1)
            out.append(m)
    return out


def chat_request(body: dict) -> tuple[pb.GenerateRequest, Options]:
    msg, opts = _common(body, None)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise WireError(400, "messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise WireError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}", "messages")
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if calls is not None and not isinstance(calls, list):
            raise WireError(400, f"messages[{i}].tool_calls must be a list", "messages")
        msg.messages.add(role=ROLES[m["role"]], content=_content(m, i), tool_calls=json.dumps(calls) if calls else "",
                         tool_call_id=str(m.get("tool_call_id") or ""))
    _tools(body, msg, opts)
    if _field(body, "logprobs", "bool"):
        opts.logprobs = _field(body, "top_logprobs", "int", 0, MAX_LOGPROBS) or 0
        msg.logprobs = opts.logprobs
    elif _field(body, "top_logprobs", "int", 0, MAX_LOGPROBS):
        raise WireError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return msg, opts


def completion_requests(body: dict) -> tuple[list[pb.GenerateRequest], Options]:
    """One GenerateRequest per prompt (a string, a list of strings, a list of token ids, or a list of those)."""
    for name in ("tools", "tool_choice"):
        if body.get(name) is not None:
            raise WireError(400, f"{name} is for chat completions (/v1/chat/completions)", name)
    msg, opts = _common(body, 16)  # OpenAI's default max_tokens for completions
    prompts = _prompts(body.get("prompt"))
    opts.logprobs = _field(body, "logprobs", "int", 0, MAX_LOGPROBS)
    opts.echo = bool(_field(body, "echo", "bool"))
    if opts.logprobs is not None:
        msg.logprobs = opts.logprobs
    msg.echo = opts.echo
    out = []
    for p in prompts:
        m = pb.GenerateRequest()
        m.CopyFrom(msg)
        m.raw_prompt = True
        if isinstance(p, str):
            m.prompt = p
        else:
            m.prompt_token_ids.extend(p)
        out.append(m)
    return out, opts


def _prompts(prompt) -> list:
    def ids(x) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str) or ids(prompt) and prompt:
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or ids(p) and p for p in prompt):
        prompts = prompt
    else:
        raise WireError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                        "token-id lists (none empty)", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise WireError(400, f"prompt holds at most {MAX_PROMPTS} prompts, got {len(prompts)}", "prompt")
    for p in prompts:
        if not isinstance(p, str) and any(not 0 <= t <= U32 for t in p):
            raise WireError(400, "prompt token ids must be non-negative integers", "prompt")
    return prompts


# ---- replies -----------------------------------------------------------------------------------

def calid_stats(stats: pb.RequestStats) -> dict:
    return MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Reply:
    """Builds one reply's objects. ``decode(ids)`` renders tokens as text (logprobs, echo); ``modes``: each
    choice's decoding mode (its calid stats say it)."""

    def __init__(self, kind: str, opts: Options, model_id: str, decode, modes: list[str]):
        self.kind, self.opts, self.model, self.modes = kind, opts, opts.model or model_id, modes
        self.decode = decode
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # completions logprobs: text offset reached, per choice
        self._held: dict[int, str | None] = {}  # chat with tools, streamed: text held back (None: plain text)

    def _token(self, token_id: int) -> str:
        return self.decode([token_id])

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # chat: logprobs {"content": [{token, logprob, bytes, top_logprobs}]}
    def _chat_logprobs(self, entries) -> dict | None:
        if self.opts.logprobs is None:
            return None

        def item(token_id, logprob):
            t = self._token(token_id)
            return {"token": t, "logprob": logprob, "bytes": list(t.encode())}

        return {"content": [{**item(e.token_id, e.logprob),
                             "top_logprobs": [item(a.token_id, a.logprob) for a in e.top]} for e in entries]}

    # completions: logprobs {tokens, token_logprobs, top_logprobs, text_offset}
    def _completion_logprobs(self, index: int, entries: list, first_unscored: int | None = None) -> dict | None:
        if self.opts.logprobs is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self._offsets.get(index, 0)

        def add(token_id, logprob, top):
            nonlocal offset
            t = self._token(token_id)
            out["tokens"].append(t)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(t)

        if first_unscored is not None:  # echo: the prompt's first token has no log-probability
            add(first_unscored, None, None)
        for e in entries:
            add(e.token_id, e.logprob, {self._token(a.token_id): a.logprob for a in e.top}
                if self.opts.logprobs else {})
        self._offsets[index] = offset
        return out

    def _echo(self, out) -> tuple[str, list]:
        """Completions with echo, first output: the prompt's text and log-probability entries."""
        if not (self.opts.echo and out.prompt_ids):
            return "", []
        return self.decode(out.prompt_ids), out.prompt_logprobs

    def _message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """A chat message's fields (content, or the tool calls it holds) and its finish reason."""
        content, calls = tool_calls.split_calls(text, self.opts.tool_names) if self.opts.tool_names else (text, [])
        if calls:
            return {"content": content, "tool_calls": calls}, "tool_calls"
        return {"content": text}, finish

    def _tool_delta(self, index: int, text: str, finish: str | None) -> tuple[dict, str | None]:
        """Streamed chat with tools: text goes out as it comes unless it may be the start of a call; a call is
        sent whole, in the choice's last chunk (each call with its index, as OpenAI streams them)."""
        if index in self._held and self._held[index] is None:  # plain text, already flowing
            return {"content": text}, finish
        held = self._held.get(index, "") + text
        if finish is not None:
            fields, finish = self._message(held, finish)
            if fields.get("tool_calls"):
                fields["tool_calls"] = [{"index": k, **c} for k, c in enumerate(fields["tool_calls"])]
            return fields, finish
        if tool_calls.may_be_a_call(held):
            self._held[index] = held
            return {}, None
        self._held[index] = None  # plain text: no call follows
        return {"content": held}, None

    def chunk(self, index: int, out, first: bool) -> dict:
        """One SSE chunk for ``out``, the ``index``-th choice's next Output."""
        finish = FINISH.get(out.result.finish_reason) if out.result is not None else None
        if self.kind == "chat":
            fields = {"content": out.text}
            if self.opts.tool_names:
                fields, finish = self._tool_delta(index, out.text, finish)
            delta = {"role": "assistant", **fields} if first else fields
            choice = {"index": index, "delta": delta if fields.get("content") or fields.get("tool_calls") or first
                      or finish is None else {},
                      "logprobs": self._chat_logprobs(out.logprobs) if out.logprobs else None,
                      "finish_reason": finish}
            obj = self._head("chat.completion.chunk")
        else:
            echo_text, echo_lp = self._echo(out) if first else ("", [])
            lp = None
            if self.opts.logprobs is not None and (out.logprobs or echo_lp or first and out.prompt_ids):
                lp = self._merge_completion_logprobs(index, out, echo_lp)
            choice = {"index": index, "text": echo_text + out.text, "logprobs": lp, "finish_reason": finish}
            obj = self._head("text_completion")
        obj["choices"] = [choice]
        if self.opts.include_usage:
            obj["usage"] = None
        if out.result is not None:
            obj["calid"] = self._stats(index, out)
        return obj

    def _merge_completion_logprobs(self, index: int, out, echo_lp: list) -> dict:
        first = out.prompt_ids[0] if self.opts.echo and out.prompt_ids else None
        return self._completion_logprobs(index, list(echo_lp) + list(out.logprobs), first)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        obj["choices"] = []
        obj["usage"] = usage(prompt_tokens, completion_tokens)
        return obj

    def whole(self, outs: list) -> dict:
        """The non-streamed reply: ``outs`` holds each choice's single Output."""
        choices = []
        for i, out in enumerate(outs):
            finish = FINISH.get(out.result.finish_reason)
            if self.kind == "chat":
                fields, finish = self._message(out.text, finish)
                choices.append({"index": i, "message": {"role": "assistant", **fields},
                                "logprobs": self._chat_logprobs(out.logprobs), "finish_reason": finish})
            else:
                echo_text, echo_lp = self._echo(out)
                lp = self._merge_completion_logprobs(i, out, echo_lp) if self.opts.logprobs is not None else None
                choices.append({"index": i, "text": echo_text + out.text, "logprobs": lp, "finish_reason": finish})
        obj = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        obj["choices"] = choices
        obj["usage"] = usage(sum(o.result.prompt_tokens for o in outs[::self.opts.n]),  # a prompt counts once
                             sum(len(o.result.output_ids) for o in outs))
        obj["calid"] = self._stats(0, outs[0]) if len(outs) == 1 else [self._stats(i, o) for i, o in enumerate(outs)]
        return obj

    def _stats(self, index: int, out) -> dict:
        return calid_stats(stats(out.result, self.modes[index]))


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_KEEPALIVE = ": keep-alive\n\n"
