"""From a validated request body to what the engine runs: prompts, SamplingParams, stop config
(completions here; chat's own part in ``plan_chat``).

These are the rules that span fields or need the tokenizer / engine limits (msgspec already
checked types and ranges). Every violation is an APIError(400), except an unknown model (404).

Choices:
- Unset sampling fields take ``generation_config.json``'s values (as vLLM does), then OpenAI's
  defaults (temperature 1, top_p 1, top_k off, min_p 0).
- ``echo`` with ``max_tokens=0`` (lm-eval's loglikelihood) asks the engine for one token and
  discards it: the scheduler always generates at least one.
- ``n > 1`` with a ``seed``: choice j gets ``seed + j`` so the samples differ but stay reproducible.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable

import msgspec

from proto.messages import GrammarSpec, SamplingParams
from tokenizer_proc.errors import APIError, bad_request
from tokenizer_proc.protocol import (
    CompletionRequest,
    NativeSamplingParams,
    SamplingFields,
)
from tokenizer_proc.request_state import StopConfig
from tokenizer_proc.structured import request_grammar
from tokenizer_proc.tokenizer import TextTokenizer, read_json
from tokenizer_proc.tool_parsers import ToolParser

DEFAULT_COMPLETION_TOKENS = 16
GEN_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class Limits:
    max_context: int
    vocab_size: int


def load_generation_defaults(model_path: str) -> dict:
    cfg = read_json(os.path.join(model_path, "generation_config.json"))
    def numeric(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    return {k: cfg[k] for k in GEN_CONFIG_KEYS if numeric(cfg.get(k))}


@dataclass
class GenPlan:
    """Everything a serving handler needs to submit and format one HTTP request."""

    prompts: list[list[int]]
    params: SamplingParams
    stop_cfg: StopConfig
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    echo: bool = False
    top_logprobs: int | None = None  # None: no logprobs in the response
    return_prompt_logprobs: bool = False  # vLLM's prompt_logprobs field (non-streaming only)
    prompt_texts: list[str] = field(default_factory=list)
    tool_parser: Callable[[], ToolParser] | None = None  # chat: makes a choice's tool_calls parser
    parallel_tool_calls: bool = True  # false: only a choice's first call is returned
    # chat with --reasoning-parser: whether the answer starts inside <think> (None: not parsed)
    reasoning: bool | None = None
    include_reasoning: bool = True  # vLLM's field: false drops the reasoning from the answer

    def choice_params(self, j: int) -> SamplingParams:
        if j == 0 or self.params.seed is None:
            return self.params
        return msgspec.structs.replace(self.params, seed=self.params.seed + j)


# ---------------------------------------------------------------------- small checks


def check_model(model: str | None, served_names: tuple[str, ...]) -> None:
    """``model`` may be omitted or any served name (``--served-model-name a b``)."""
    if model is not None and model not in served_names:
        raise APIError(404, f"The model `{model}` does not exist.", "model")


def check_token_ids(ids: list[int], limits: Limits, param: str) -> None:
    for t in ids:
        if not 0 <= t < limits.vocab_size:
            raise bad_request(f"token id {t} is out of range [0, {limits.vocab_size})", param)


LOGIT_BIAS_LIMIT = 100.0  # OpenAI's documented range; vLLM clamps to it


def check_logit_bias(bias: dict[str, float] | None, limits: Limits, param: str = "logit_bias") -> None:
    """Keys are token ids (decimal strings) inside the vocabulary; values finite numbers."""
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", param) from None
        if not 0 <= token < limits.vocab_size:
            raise bad_request(f"logit_bias token id {token} is out of range [0, {limits.vocab_size})", param)
        if not math.isfinite(value):
            raise bad_request(f"logit_bias value for token {token} must be a finite number", param)


def logit_bias_pairs(bias: dict[str, float] | None) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Checked ``logit_bias`` -> (token ids, biases clamped to [-100, 100]), in id order. A key
    repeated under two spellings ("5", "05") keeps the last value, as a dict of ints would."""
    merged = {int(k): max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(v))) for k, v in (bias or {}).items()}
    ids = tuple(sorted(merged))
    return ids, tuple(merged[i] for i in ids)


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(s == "" for s in stops):
        raise bad_request("stop strings must not be empty", "stop")
    return stops


def check_text_length(text: str, tok: TextTokenizer, max_context: int, param: str) -> None:
    """Refuse, before tokenizing, a text too long for any context of ``max_context`` tokens.

    The tokenizers library holds the GIL: encoding 10 MB takes tens of seconds during which the
    event loop, and so every other stream, stands still. Such a text could never be served.
    """
    cap = tok.max_text_chars(max_context)
    if len(text) > cap:
        raise bad_request(
            f"This model's maximum context length is {max_context} tokens. However, your {param} is "
            f"{len(text)} characters long, more than {max_context} tokens can hold ({cap} characters at most). "
            f"Please reduce the length of the {param}.",
            param,
        )


def encode_prompt(text: str, tok: TextTokenizer, limits: Limits, param: str, add_special_tokens: bool = True):
    check_text_length(text, tok, limits.max_context, param)
    return tok.encode(text, add_special_tokens=add_special_tokens)


def check_context(prompt_len: int, max_tokens: int, limits: Limits, param: str = "max_tokens") -> None:
    if prompt_len + max_tokens > limits.max_context:
        raise bad_request(
            f"This model's maximum context length is {limits.max_context} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
            "Please reduce the length of the prompt or completion.",
            param,
        )


def check_min_tokens(min_tokens: int | None, max_tokens: int, param: str = "min_tokens") -> None:
    if min_tokens and min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) must be less than or equal to max_tokens ({max_tokens})",
                          param)


def include_usage(req: SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def continuous_usage(req: SamplingFields) -> bool:
    """Usage on every chunk needs ``include_usage`` too (vLLM: ``include_usage and
    continuous_usage_stats``); ``continuous_usage_stats`` alone sends no usage at all."""
    return include_usage(req) and bool(req.stream_options and req.stream_options.continuous_usage_stats)


def check_unsupported(req: SamplingFields) -> None:
    # suffix is limited to its no-op value by protocol.py.
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")


def sampling_params(
    req: SamplingFields | NativeSamplingParams,
    max_new_tokens: int,
    defaults: dict,
    logprobs: int = -1,
    prompt_logprobs: int = -1,
    min_tokens: int | None = None,
    seed: int | None = None,
    grammar: GrammarSpec | None = None,
) -> SamplingParams:
    def pick(name: str, fallback):
        value = getattr(req, name, None)
        return value if value is not None else defaults.get(name, fallback)

    top_k = int(pick("top_k", -1))
    bias_ids, bias = logit_bias_pairs(getattr(req, "logit_bias", None))
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_tokens or 0,
        temperature=float(pick("temperature", 1.0)),
        top_p=float(pick("top_p", 1.0)),
        top_k=-1 if top_k <= 0 else top_k,
        min_p=float(pick("min_p", 0.0)),
        seed=seed,
        ignore_eos=bool(req.ignore_eos),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=float(pick("repetition_penalty", 1.0)),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias_ids=bias_ids,
        logit_bias=bias,
        grammar=grammar,
    )


def stop_config(req: SamplingFields, discard: bool = False, keep_special: bool = False) -> StopConfig:
    """``keep_special``: a tool parser reads tags that are special tokens (vLLM's parsers turn
    ``skip_special_tokens`` off for themselves the same way)."""
    return StopConfig(
        stop=stop_strings(req.stop),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        skip_special_tokens=req.skip_special_tokens is not False and not keep_special,
        discard_generation=discard,
    )


# ---------------------------------------------------------------------- /v1/completions


def completion_prompts(prompt, tok: TextTokenizer, limits: Limits) -> list[tuple[list[int], str | None]]:
    """str | [str] | [int] | [[int]] -> (token ids, original text or None), one per prompt."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    elif all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        items = list(prompt)
    else:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of lists "
                          "of token ids", "prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            if item == "":
                raise bad_request("prompt must not be empty", "prompt")
            out.append((encode_prompt(item, tok, limits, "prompt"), item))
        else:
            if not item:
                raise bad_request("prompt must not be empty", "prompt")
            check_token_ids(item, limits, "prompt")
            out.append((list(item), None))
    return out


def plan_completion(req: CompletionRequest, tok: TextTokenizer, limits: Limits, defaults: dict) -> GenPlan:
    check_unsupported(req)
    echo = bool(req.echo)
    max_tokens = DEFAULT_COMPLETION_TOKENS if req.max_tokens is None else req.max_tokens
    if max_tokens == 0 and not echo:
        raise bad_request("max_tokens must be at least 1 (0 is only allowed with echo)", "max_tokens")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs is not available when streaming", "prompt_logprobs")
    pairs = completion_prompts(req.prompt, tok, limits)
    prompts = [ids for ids, _ in pairs]
    for ids in prompts:
        # echo + max_tokens=0 still makes the engine generate one token (discarded), which needs
        # a free position: refuse here, as a 400 before any stream starts, not as an engine error.
        check_context(len(ids), max(1, max_tokens), limits)
    check_min_tokens(req.min_tokens, max_tokens)
    if req.stop_token_ids:
        check_token_ids(req.stop_token_ids, limits, "stop_token_ids")
    check_logit_bias(req.logit_bias, limits)
    logprobs = -1 if req.logprobs is None else req.logprobs
    prompt_lp = req.prompt_logprobs if req.prompt_logprobs is not None else (logprobs if echo else -1)
    params = sampling_params(req, max(1, max_tokens), defaults, logprobs, prompt_lp, req.min_tokens, req.seed,
                             request_grammar(req))
    return GenPlan(
        prompts=prompts,
        params=params,
        stop_cfg=stop_config(req, discard=max_tokens == 0),
        n=req.n or 1,
        stream=bool(req.stream),
        include_usage=include_usage(req),
        continuous_usage=continuous_usage(req),
        echo=echo,
        top_logprobs=req.logprobs,
        return_prompt_logprobs=req.prompt_logprobs is not None,
        # Echo returns the prompt as sent; token prompts are decoded like the completion.
        prompt_texts=[text if text is not None else tok.decode(ids, req.skip_special_tokens is not False)
                      for ids, text in pairs] if echo else [],
    )
