"""Tool calls (OpenAI ``tools`` / ``tool_choice``) through the model's own chat template.

A call is written as Qwen2.5's template (and the Hermes format it follows) asks:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``prompt_ids`` renders the conversation with the tools (a template that ignores
them gets them in a system message in that format instead); ``call_grammar``
constrains the output to one or more such calls whose arguments follow the
function's JSON schema (tool_choice ``required`` or a named function; ``auto``
lets the model choose, ``none`` hides nothing but asks for no call);
``split_calls`` reads the calls back out of the text.
"""
from __future__ import annotations

import json
import re
import uuid

from calid.decoding.grammar import JSON_LAYOUT, Grammar
from calid.errors import InvalidRequestError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TOOLS = 128
CHOICES = ("none", "auto", "required")


def check_tools(tools) -> list[dict]:
    """OpenAI tool definitions, checked: ``[{"type": "function", "function": {"name", "description"?,
    "parameters"?}}]``; raises InvalidRequestError naming the bad entry."""
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise InvalidRequestError(f"tools must be a list of 1 to {MAX_TOOLS} function definitions")
    names = set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not NAME.fullmatch(f["name"]):
            raise InvalidRequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                                      "with a name of letters, digits, _ . - (at most 64)")
        if not isinstance(f.get("parameters", {}), dict) or not isinstance(f.get("description", ""), str):
            raise InvalidRequestError(f"tools[{i}].function: parameters must be a JSON schema object and "
                                      "description a string")
        if f["name"] in names:
            raise InvalidRequestError(f"tools[{i}]: the name {f['name']!r} is given twice")
        names.add(f["name"])
    return [{"type": "function", "function": t["function"]} for t in tools]


def check_choice(choice: str, tools: list[dict]) -> str:
    """``none``, ``auto``, ``required`` or the name of one of ``tools``."""
    if choice in CHOICES or choice in {t["function"]["name"] for t in tools}:
        return choice
    raise InvalidRequestError(f"tool_choice must be none, auto, required or a function of tools, got {choice!r}")


def call_grammar(tools: list[dict], choice: str, tokenizer, parallel: bool = True) -> Grammar | None:
    """Calls of ``tools`` (``required``: one, or one or more with ``parallel``) or one call of the function
    ``choice`` names, each call's arguments under its function's schema; None when the model chooses (auto) or
    calls nothing (none)."""
    if choice in ("none", "auto"):
        return None
    chosen = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice]
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for f in chosen]
    schema = {"anyOf": calls, "x-guidance": JSON_LAYOUT}
    more = '("\\n" call)*' if parallel and choice == "required" else ""
    lark = (f"start: call {more}\ncall: open \"\\n\" body \"\\n\" close\n"
            f"open: {_literal(tokenizer, OPEN)}\nclose: {_literal(tokenizer, CLOSE)}\n"
            f"body: %json {json.dumps(schema)}")
    return Grammar.compile("lark", lark)


def _literal(tokenizer, text: str) -> str:
    """``text`` in Lark: the tokenizer's own token for it where it has one (llguidance matches added tokens
    only by id), else the string."""
    vocab = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return f"<[{vocab[text]}]>" if text in vocab else json.dumps(text)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: an assistant's tool calls with their arguments as objects."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"type": "function", "id": c.get("id"),
                                "function": {"name": c["function"]["name"],
                                             "arguments": _arguments(c["function"].get("arguments"))}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def _arguments(raw):
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw or {}


def prompt_text(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    """The conversation through the model's chat template with its tools; a template that leaves the tools
    out gets them in a system message in the format ``split_calls`` reads."""
    messages = template_messages(messages)
    plain = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not tools:
        return plain
    with_tools = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    if with_tools != plain:
        return with_tools
    listing = "\n".join(json.dumps(t) for t in tools)
    note = (f"You can call functions. Their signatures, one per line, inside <tools></tools>:\n<tools>\n{listing}\n"
            f"</tools>\nTo call one, answer with a JSON object of its name and arguments inside tags:\n{OPEN}\n"
            f'{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{CLOSE}')
    if messages and messages[0].get("role") == "system":
        messages = [{**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{note}"}] + messages[1:]
    else:
        messages = [{"role": "system", "content": note}] + messages
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


CALL = re.compile(re.escape(OPEN) + r"\s*(\{.*?\})\s*" + re.escape(CLOSE), re.S)


def split_calls(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """(the text before the first call, or None if there is none, and the calls) when ``text`` holds calls
    of ``names`` in the template's format, or is nothing but such a call's JSON object (small models calling
    on their own often leave the tags out), else (text, [])."""
    found = [m.group(1) for m in CALL.finditer(text)]
    bare = not found and text.strip().startswith("{")
    calls = []
    for raw in found or ([text.strip()] if bare else []):
        try:
            obj = json.loads(raw)
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or obj.get("name") not in names or not isinstance(obj.get("arguments", {}), dict):
            return text, []
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}))}})
    if not calls:
        return text, []
    before = "" if bare else text[: text.index(OPEN)].strip()
    return before or None, calls


def may_be_a_call(text: str) -> bool:
    """Whether streamed text so far may still turn out to be a call (hold it back until it is known)."""
    head = text.lstrip()
    return head.startswith((OPEN, "{")) or OPEN.startswith(head)
