"""``tandem.SamplingParams``: vLLM's offline sampling parameters, under vLLM's names, turned into
the HTTP front's request fields so that one set of rules (``tokenizer_proc/params.py``,
``plan_chat.py``, ``structured.py``) checks and converts both paths.

Fields left at ``None`` behave as in an HTTP request that leaves them out: ``temperature``,
``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` take the model's
``generation_config.json`` values, else vLLM's defaults (1, 1, off, 0, 1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams``: one constraint (``json``, ``regex``, ``choice``,
    ``grammar``, ``json_object``, ``structural_tag``) plus options, as the HTTP API's
    ``structured_outputs`` (docs/http_api.md)."""

    json: Any = None  # a JSON Schema (dict) or its text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # GBNF / EBNF with a `root` rule
    json_object: bool | None = None
    structural_tag: Any = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None

    def fields(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None and v is not False}


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one prompt's completions (vLLM's names and defaults).

    ``logprobs=k``: each generated token's logprob plus its top k alternatives;
    ``prompt_logprobs=k``: the same for the prompt's tokens. ``detokenize=False`` leaves ``text``
    empty (token ids only: no detokenizer work; stop strings need the text, so they are refused).
    ``max_tokens=None``: up to the end of the context.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    detokenize: bool = True

    def request_fields(self) -> dict:
        """The fields an HTTP request body would carry for these parameters (unset ones left
        out, so the server's defaults apply), ``max_tokens`` and the logprobs excepted: their
        spelling differs between completions and chat (``completion_fields``, ``chat_fields``)."""
        skip = {"max_tokens", "logprobs", "prompt_logprobs", "structured_outputs", "detokenize", "logit_bias"}
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        out = {k: v for k, v in out.items() if v is not None}
        if self.logit_bias:
            out["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}  # OpenAI's keys are strings
        if self.structured_outputs is not None:
            out["structured_outputs"] = self.structured_outputs.fields()
        if not self.detokenize and self.stop:
            raise ValueError("stop strings need the text: they cannot be used with detokenize=False")
        return out

    def completion_fields(self, max_tokens: int) -> dict:
        """``/v1/completions``' body for one prompt (``max_tokens`` resolved by the caller)."""
        out = {**self.request_fields(), "max_tokens": max_tokens}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs
        return out

    def chat_fields(self) -> dict:
        """``/v1/chat/completions``' body (its ``prompt_logprobs`` is set on the plan: chat has no
        such field)."""
        out = self.request_fields()
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if self.logprobs is not None:
            out.update(logprobs=True, top_logprobs=self.logprobs)
        return out
