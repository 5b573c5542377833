"""calid.v1 protobuf messages <-> engine types, with field checks that name the field."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from calid import tool_calls
from calid.decoding.grammar import Grammar
from calid.decoding.modes import DecodeParams
from calid.decoding.quality_budget import QualityTable, budget_decoding
from calid.errors import InvalidRequestError
from calid.generation import GenerationRequest, GenerationResult, SamplingParams
from calid.text import encode_prompt
from calid.v1 import calid_pb2 as pb

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server; checked before the chat template or tokenizer run."""

    max_request_bytes: int = 1 << 20
    max_new_tokens: int = 4096
    max_stop: int = 16
    max_stop_chars: int = 256
    max_messages: int = 64
    max_prompt_tokens: int | None = None


def check_limits(msg: pb.GenerateRequest, limits: Limits) -> None:
    """Refuse an oversized request by its wire size and counts alone (no tokenizing)."""
    size = msg.ByteSize()
    if size > limits.max_request_bytes:
        raise InvalidRequestError(f"request is {size} bytes, over the server's limit of {limits.max_request_bytes}")
    if msg.HasField("max_new_tokens") and msg.max_new_tokens > limits.max_new_tokens:
        raise InvalidRequestError(f"max_new_tokens must be at most {limits.max_new_tokens}, got {msg.max_new_tokens}")
    if len(msg.stop) > limits.max_stop:
        raise InvalidRequestError(f"stop takes at most {limits.max_stop} strings, got {len(msg.stop)}")
    if msg.HasField("logprobs") and msg.logprobs > MAX_LOGPROBS:
        raise InvalidRequestError(
            f"logprobs must be at most {MAX_LOGPROBS} (alternatives per token), got {msg.logprobs}"
        )
    if any(len(s) > limits.max_stop_chars for s in msg.stop):
        raise InvalidRequestError(f"stop strings may be at most {limits.max_stop_chars} characters long")
    if len(msg.messages) > limits.max_messages:
        raise InvalidRequestError(f"messages takes at most {limits.max_messages} entries, got {len(msg.messages)}")


MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's own limit)


def score_only(msg: pb.GenerateRequest) -> bool:
    """Echo with max_new_tokens = 0: the prompt is scored and nothing is generated."""
    return msg.echo and msg.HasField("max_new_tokens") and msg.max_new_tokens == 0


def prompt_ids(msg: pb.GenerateRequest, tokenizer, tools: list[dict] | None = None) -> list[int]:
    """The prompt's token ids; ``tools`` (``tools_of(msg)``) go through the chat template."""
    if sum(map(bool, (msg.prompt, msg.messages, msg.prompt_token_ids))) > 1:
        raise InvalidRequestError("set one of prompt, messages or prompt_token_ids, not several")
    if msg.prompt_token_ids:
        return list(msg.prompt_token_ids)
    if msg.messages:
        for i, m in enumerate(msg.messages):
            if m.role not in ROLES:
                raise InvalidRequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.role!r}")
        messages = [_message(m, i) for i, m in enumerate(msg.messages)]
        if msg.tools or any(m.tool_calls or m.role == "tool" for m in msg.messages):
            text = tool_calls.prompt_text(tokenizer, messages, tools)
            return tokenizer(text, add_special_tokens=False).input_ids
        return encode_prompt(tokenizer, messages)
    if not msg.prompt:
        raise InvalidRequestError("prompt is empty (set prompt or messages)")
    return encode_prompt(tokenizer, msg.prompt, chat=not msg.raw_prompt)


def _message(m: pb.ChatMessage, i: int) -> dict:
    out = {"role": m.role, "content": m.content}
    if m.tool_calls:
        try:
            out["tool_calls"] = json.loads(m.tool_calls)
            assert isinstance(out["tool_calls"], list) and all(isinstance(c["function"]["name"], str)
                                                                for c in out["tool_calls"])
        except (ValueError, AssertionError, KeyError, TypeError):
            raise InvalidRequestError(f"messages[{i}].tool_calls must be a JSON array of OpenAI tool calls") from None
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def tools_of(msg: pb.GenerateRequest) -> list[dict] | None:
    """The request's tools, checked (None when it has none)."""
    if not msg.tools:
        return None
    try:
        tools = json.loads(msg.tools)
    except ValueError:
        raise InvalidRequestError("tools must be a JSON array of function definitions") from None
    return tool_calls.check_tools(tools)


def to_request(msg: pb.GenerateRequest, tokenizer, default: DecodeParams, limits: Limits = Limits(),
               quality: tuple[QualityTable | None, str] | None = None, edge: bool = False) -> GenerationRequest:
    """A GenerationRequest from the wire; raises InvalidRequestError naming the bad field. ``quality``: the served
    pair's quality table and where it came from (max_quality_loss's threshold); None: the model has no draft.
    ``edge``: an edge client's Collaborate stream (a budget stays filter's, whatever its threshold)."""
    check_limits(msg, limits)
    for name in ("temperature", "top_p", "threshold", "min_agreement", "rollback_nll", "max_quality_loss"):
        if msg.HasField(name) and not math.isfinite(getattr(msg, name)):
            raise InvalidRequestError(f"{name} must be a finite number, got {getattr(msg, name)!r}")
    if msg.HasField("max_new_tokens") and msg.max_new_tokens == 0 and not msg.echo:
        raise InvalidRequestError("max_new_tokens must be >= 1 (0 only with echo: score the prompt)")
    tools = tools_of(msg)
    params = SamplingParams(
        max_new_tokens=(msg.max_new_tokens or 1) if msg.HasField("max_new_tokens") else SamplingParams.max_new_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else 0.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k if msg.HasField("top_k") else 0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
        grammar=grammar_of(msg, tokenizer, tools),
    ).validate()
    budget = msg.min_agreement if msg.HasField("min_agreement") else None
    loss = msg.max_quality_loss if msg.HasField("max_quality_loss") else None
    if (budget is not None) + (loss is not None) + msg.HasField("threshold") > 1:
        raise InvalidRequestError("set one of threshold, min_agreement and max_quality_loss (a budget chooses the "
                                  "threshold)")
    mode = msg.mode or ("filter" if budget is not None or loss is not None else default.mode)
    if msg.HasField("rollback_nll") and mode != "rollback":
        raise InvalidRequestError(f"rollback_nll is a bound for mode rollback, not {mode!r}")
    if loss is not None and mode != "filter":
        raise InvalidRequestError(f"max_quality_loss is a budget for mode filter, not {mode!r}")
    if loss is not None and quality is None:
        raise InvalidRequestError("max_quality_loss is filter's budget and needs a draft model; this model has none")
    threshold = msg.threshold if msg.HasField("threshold") else default.threshold
    if loss is not None:
        mode, threshold = budget_decoding(loss, *quality, edge=edge)
    decode = DecodeParams(
        mode=mode,
        gamma=msg.gamma if msg.HasField("gamma") else default.gamma,
        threshold=threshold,
        filter_threshold=default.filter_threshold,
        rollback_nll=msg.rollback_nll if msg.HasField("rollback_nll") else default.rollback_nll,
        min_agreement=budget,
        max_quality_loss=loss,
    ).validate()
    ids = prompt_ids(msg, tokenizer, tools)
    if limits.max_prompt_tokens is not None and len(ids) > limits.max_prompt_tokens:
        raise InvalidRequestError(f"prompt is {len(ids)} tokens, over the server's limit of {limits.max_prompt_tokens}")
    return GenerationRequest(ids, params, None, decode)


def grammar_of(msg: pb.GenerateRequest, tokenizer, tools: list[dict] | None) -> Grammar | None:
    """The request's structured-output constraint, compiled (InvalidRequestError names what is wrong): its
    grammar, or the calls its tool_choice asks for of ``tools`` (``tools_of(msg)``)."""
    if msg.tool_choice and not tools:
        raise InvalidRequestError("tool_choice needs tools")
    parallel = msg.parallel_tool_calls if msg.HasField("parallel_tool_calls") else True
    calls = tool_calls.call_grammar(tools, tool_calls.check_choice(msg.tool_choice or "auto", tools), tokenizer,
                                    parallel) if tools else None
    if calls and msg.HasField("grammar"):
        raise InvalidRequestError("a grammar and a tool_choice that asks for calls cannot both hold: give one")
    if calls or not msg.HasField("grammar"):
        return calls
    kind = msg.grammar.WhichOneof("kind")
    if kind is None or kind == "json_object" and not msg.grammar.json_object:
        raise InvalidRequestError("grammar is set but empty: give json_schema, json_object, regex or lark")
    return Grammar.compile(kind, "" if kind == "json_object" else getattr(msg.grammar, kind))


def stats(result: GenerationResult, mode: str) -> pb.RequestStats:
    s = result.stats
    return pb.RequestStats(
        prompt_tokens=result.prompt_tokens, output_tokens=len(result.output_ids),
        draft_tokens=s.draft_tokens, target_tokens=s.target_tokens, filtered_fraction=s.filtered_fraction,
        target_calls=s.target_calls, draft_forwards=s.draft_calls, mean_accepted=s.mean_accepted,
        ttft_ms=result.ttft_s * 1000, total_ms=result.total_s * 1000, tokens_per_s=result.tokens_per_s, mode=mode,
    )
