from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CollaborateRequest(_message.Message):
    __slots__ = ("open", "round")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    open: GenerateRequest
    round: DraftRound
    def __init__(self, open: _Optional[_Union[GenerateRequest, _Mapping]] = ..., round: _Optional[_Union[DraftRound, _Mapping]] = ...) -> None: ...

class DraftRound(_message.Message):
    __slots__ = ("round", "tokens", "confidence", "rows")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    round: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    confidence: _containers.RepeatedScalarFieldContainer[float]
    rows: _containers.RepeatedCompositeFieldContainer[SparseRow]
    def __init__(self, round: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., confidence: _Optional[_Iterable[float]] = ..., rows: _Optional[_Iterable[_Union[SparseRow, _Mapping]]] = ...) -> None: ...

class SparseRow(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class CollaborateReply(_message.Message):
    __slots__ = ("request_id", "round", "prompt_ids", "accepted", "token_ids", "text", "max_draft", "threshold", "finish_reason", "stats")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    round: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    accepted: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    max_draft: int
    threshold: float
    finish_reason: str
    stats: RequestStats
    def __init__(self, request_id: _Optional[str] = ..., round: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., accepted: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., max_draft: _Optional[int] = ..., threshold: _Optional[float] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: str
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[str] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "messages", "raw_prompt", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "mode", "threshold", "gamma", "model", "logprobs", "echo", "prompt_token_ids", "min_agreement", "grammar", "tools", "tool_choice", "parallel_tool_calls", "rollback_nll", "max_quality_loss")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    RAW_PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_NLL_FIELD_NUMBER: _ClassVar[int]
    MAX_QUALITY_LOSS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    raw_prompt: bool
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    mode: str
    threshold: float
    gamma: int
    model: str
    logprobs: int
    echo: bool
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    min_agreement: float
    grammar: Grammar
    tools: str
    tool_choice: str
    parallel_tool_calls: bool
    rollback_nll: float
    max_quality_loss: float
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., raw_prompt: _Optional[bool] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., mode: _Optional[str] = ..., threshold: _Optional[float] = ..., gamma: _Optional[int] = ..., model: _Optional[str] = ..., logprobs: _Optional[int] = ..., echo: _Optional[bool] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., min_agreement: _Optional[float] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., tools: _Optional[str] = ..., tool_choice: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., rollback_nll: _Optional[float] = ..., max_quality_loss: _Optional[float] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "lark")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    lark: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class RequestStats(_message.Message):
    __slots__ = ("prompt_tokens", "output_tokens", "draft_tokens", "target_tokens", "filtered_fraction", "target_calls", "draft_forwards", "mean_accepted", "ttft_ms", "total_ms", "tokens_per_s", "mode")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FILTERED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    TARGET_CALLS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    output_tokens: int
    draft_tokens: int
    target_tokens: int
    filtered_fraction: float
    target_calls: int
    draft_forwards: int
    mean_accepted: float
    ttft_ms: float
    total_ms: float
    tokens_per_s: float
    mode: str
    def __init__(self, prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., target_tokens: _Optional[int] = ..., filtered_fraction: _Optional[float] = ..., target_calls: _Optional[int] = ..., draft_forwards: _Optional[int] = ..., mean_accepted: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., mode: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "stats", "logprobs", "prompt_ids", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: RequestStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "stats", "logprobs", "prompt_ids", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: RequestStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("serving", "active_requests", "queued_requests", "queue_capacity")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    active_requests: int
    queued_requests: int
    queue_capacity: int
    def __init__(self, serving: _Optional[bool] = ..., active_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., queue_capacity: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("role", "name", "vocab_size", "max_position", "served_as", "modes", "default_mode")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_FIELD_NUMBER: _ClassVar[int]
    SERVED_AS_FIELD_NUMBER: _ClassVar[int]
    MODES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODE_FIELD_NUMBER: _ClassVar[int]
    role: str
    name: str
    vocab_size: int
    max_position: int
    served_as: str
    modes: _containers.RepeatedScalarFieldContainer[str]
    default_mode: str
    def __init__(self, role: _Optional[str] = ..., name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_position: _Optional[int] = ..., served_as: _Optional[str] = ..., modes: _Optional[_Iterable[str]] = ..., default_mode: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "modes", "default_mode")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    MODES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODE_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    modes: _containers.RepeatedScalarFieldContainer[str]
    default_mode: str
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., modes: _Optional[_Iterable[str]] = ..., default_mode: _Optional[str] = ...) -> None: ...
