"""Request bodies as msgspec Structs: the single source of both validation and the OpenAPI schema.

Unknown fields are ignored (msgspec's default), as vLLM and SGLang do: benchmark clients send
extras such as ``best_of``. Type and range errors come from the ``Meta`` constraints below; rules
that span fields live in ``params.py``. Every failure becomes HTTP 400 (``errors.py``).

msgspec allows only one array type per union, so ``prompt`` and ``input_ids`` are declared wider
than what is accepted; ``params.py`` checks the exact shapes and ``openapi.py`` publishes them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

MAX_LOGPROBS = 20
MAX_N = 128
MAX_LOGIT_BIAS = 1024  # entries per request: a per-slot table row on the worker (processors.py)
I64_MIN, I64_MAX = -(2**63), 2**63 - 1

NonNegInt = Annotated[int, Meta(ge=0)]
PosInt = Annotated[int, Meta(ge=1)]
Temperature = Annotated[float, Meta(ge=0.0, le=1000.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepPenalty = Annotated[float, Meta(gt=0.0, le=100.0)]
Seed = Annotated[int, Meta(ge=I64_MIN, le=I64_MAX)]
NumChoices = Annotated[int, Meta(ge=1, le=MAX_N)]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
TOKEN_ID_MAX = 2**31 - 1  # replaced by the engine's vocabulary in /openapi.json
TokenId = Annotated[int, Meta(ge=0, le=TOKEN_ID_MAX)]
StopStrings = Union[str, list[str]]
# Wider than accepted: str | [str] | [int] | [[int]] (see module docstring).
PromptType = Union[str, list[Union[str, int, list[int]]]]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """OpenAI's ``response_format.json_schema``; a missing ``schema`` means any JSON object."""

    name: str | None = None
    description: str | None = None
    schema: Any = None  # an object or a boolean (structured.py checks it)
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema", "structural_tag"] = "text"
    json_schema: JsonSchemaFormat | None = None
    schema: Any = None  # SGLang: a json_schema format may carry its schema here instead
    format: Any = None  # structural_tag (xgrammar's format object)
    structures: Any = None  # structural_tag, the older form: [{begin, schema, end}] ...
    triggers: Any = None  # ... and the strings that open them


class StructuredOutputs(msgspec.Struct, kw_only=True):
    """vLLM's ``structured_outputs``: at most one constraint, and options that bind the
    constraint whichever field carries it (structured.py, ``with_options``);
    ``structural_tag`` is the tag's JSON text (or object)."""

    json: Any = None  # a JSON Schema, or its text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    disable_any_whitespace: bool = False  # JSON with fixed separators
    disable_additional_properties: bool = False  # already so: xgrammar lists only the schema's properties
    disable_fallback: bool = False  # nothing to fall back from: one grammar backend
    whitespace_pattern: str | None = None  # outlines' option: a 400 (xgrammar has none)


class ConstraintFields(msgspec.Struct, kw_only=True):
    """The constraint fields outside ``response_format`` (structured.py reads them all)."""

    structured_outputs: StructuredOutputs | None = None
    guided_json: Any = None  # vLLM's older names
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    json_schema: Any = None  # SGLang's: schema text (an object is accepted too)
    regex: str | None = None
    ebnf: str | None = None


class SamplingFields(ConstraintFields, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extensions)."""

    model: str | None = None
    n: NumChoices | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: StopStrings | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepPenalty | None = None
    min_tokens: NonNegInt | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # token id (as a string, OpenAI's form) -> bias added to its logit, clamped to [-100, 100] as vLLM
    logit_bias: Annotated[dict[str, float], Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: PromptType
    max_tokens: NonNegInt | None = None  # default 16; 0 only with echo
    echo: bool | None = None
    logprobs: TopLogprobs | None = None
    prompt_logprobs: TopLogprobs | None = None
    suffix: Annotated[str, Meta(max_length=0, description="not supported: only ''")] | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    """Text models only: other part types (images, audio) are rejected."""

    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct, kw_only=True):
    """Only for validation and the schema: the template receives the original dict (extra keys
    such as ``tool_calls`` or ``reasoning_content`` included)."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None  # required for most roles (chat_messages.py)
    name: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[dict[str, Any]]
    max_tokens: PosInt | None = None
    max_completion_tokens: PosInt | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    # Unset: true, or false with continue_final_message (both true is a 400, as in vLLM).
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False  # continue the last (assistant) message, unclosed
    echo: bool | None = None  # vLLM's: a final assistant message starts the answer
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's: needs --trust-request-chat-template
    include_reasoning: bool | None = None  # vLLM's (default true): false drops the reasoning
    separate_reasoning: bool | None = None  # SGLang's (default true): false leaves <think> in the content
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # false: only the first parsed call is returned (vLLM)
    documents: list[dict[str, Any]] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: true for prompt, false for messages
    add_generation_prompt: bool | None = None  # as in ChatCompletionRequest
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # as in ChatCompletionRequest
    chat_template: str | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


class NativeSamplingParams(msgspec.Struct, kw_only=True):
    """SGLang's ``sampling_params`` for /generate."""

    max_new_tokens: NonNegInt | None = None  # SGLang's default is 128
    min_new_tokens: NonNegInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    stop: StopStrings | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepPenalty | None = None
    n: Annotated[int, Meta(ge=1, le=1)] | None = None
    logit_bias: Annotated[dict[str, float], Meta(max_length=MAX_LOGIT_BIAS)] | None = None  # as SamplingFields
    sampling_seed: Seed | None = None
    seed: Seed | None = None
    json_schema: Any = None  # structured output (structured.py): SGLang's three constraints
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: Any = None  # the tag's JSON text (or object)


class GenerateRequest(msgspec.Struct, kw_only=True):
    text: str | None = None
    input_ids: list[TokenId] | None = None
    sampling_params: NativeSamplingParams | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: TopLogprobs | None = None
    logprob_start_len: int | None = None
    rid: Annotated[str, Meta(min_length=1, max_length=256)] | None = None


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


REQUEST_TYPES = (
    CompletionRequest,
    ChatCompletionRequest,
    TokenizeRequest,
    DetokenizeRequest,
    GenerateRequest,
    ErrorResponse,
    ChatMessage,
)
