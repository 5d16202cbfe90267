"""Response pieces shared by the OpenAI handlers: logprobs objects and usage.

Token strings in logprobs are each token decoded on its own (a partial UTF-8 character shows as
U+FFFD, as in vLLM). The chosen token always appears in ``top_logprobs`` (vLLM does the same), so
lm-eval's "is greedy" check — the best entry equals the chosen token — works with ``logprobs=1``.
JSON has no -inf: such logprobs are reported as -9999.0.
"""

from __future__ import annotations

import time
import uuid
from typing import Sequence

from proto.messages import SamplingParams
from tokenizer_proc.request_state import RequestState, TokenLogprob
from tokenizer_proc.tokenizer import TextTokenizer

NEG_INF_LOGPROB = -9999.0


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def openai_stop_reason(matched: str | int | None, params: SamplingParams, eos_id: int | None) -> str | int | None:
    """``stop_reason`` as vLLM reports it: the stop string, or the stop token id, except
    ``None`` for the tokenizer's EOS (vLLM checks that token before ``stop_token_ids``, so a
    user stop id equal to it reads as EOS too, unless ``ignore_eos``). Other
    generation-config EOS ids are ids: vLLM folds them into ``stop_token_ids``.
    ``/generate`` keeps the raw id (SGLang's ``matched_stop``)."""
    if isinstance(matched, int) and matched == eos_id and not params.ignore_eos:
        return None
    return matched


def _lp(value: float) -> float:
    return value if value > NEG_INF_LOGPROB else NEG_INF_LOGPROB


class CompletionLogprobs:
    """Accumulates the legacy completions logprobs object (tokens / token_logprobs / ...)."""

    def __init__(self, tok: TextTokenizer, k: int, text_offset: int = 0):
        self.tok = tok
        self.k = k
        self.offset = text_offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def _append(self, token_id: int, entry: TokenLogprob | None) -> None:
        text = self.tok.token_str(token_id)
        self.tokens.append(text)
        self.text_offset.append(self.offset)
        self.offset += len(text)
        if entry is None:  # the first prompt token has no logprob
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
            return
        chosen, alternatives = entry
        top = {self.tok.token_str(t): _lp(lp) for t, lp in alternatives[: self.k]}
        top.setdefault(text, _lp(chosen))
        self.token_logprobs.append(_lp(chosen))
        self.top_logprobs.append(top)

    def add_prompt(self, prompt_ids: Sequence[int], prompt_logprobs: list[TokenLogprob] | None) -> None:
        entries = prompt_logprobs or []
        for i, token_id in enumerate(prompt_ids):
            # Engine rows describe prompt tokens 1..P-1; a missing row reads as "no logprob".
            self._append(token_id, None if i == 0 or i - 1 >= len(entries) else entries[i - 1])

    def add(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob]) -> None:
        for i, token_id in enumerate(token_ids):
            self._append(token_id, entries[i] if i < len(entries) else None)

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def _chat_entry(tok: TextTokenizer, token_id: int, logprob: float) -> dict:
    text = tok.token_str(token_id)
    return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tok: TextTokenizer, token_ids: Sequence[int], entries: Sequence[TokenLogprob], k: int) -> dict:
    content = []
    for i, token_id in enumerate(token_ids):
        chosen, alternatives = entries[i] if i < len(entries) else (0.0, [])
        item = _chat_entry(tok, token_id, chosen)
        item["top_logprobs"] = [_chat_entry(tok, t, lp) for t, lp in alternatives[:k]]
        content.append(item)
    return {"content": content}


def vllm_prompt_logprobs(tok: TextTokenizer, prompt_ids: Sequence[int], entries: list[TokenLogprob] | None) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else
    ``{token_id: {logprob, rank, decoded_token}}`` for the token itself and its top alternatives."""
    rows = entries or []
    out: list = [None]
    for i, token_id in enumerate(prompt_ids[1:]):
        if i >= len(rows):
            out.append(None)
            continue
        chosen, alternatives = rows[i]
        ranks = {t: r + 1 for r, (t, _) in enumerate(alternatives)}
        row = {str(t): {"logprob": _lp(lp), "rank": r + 1, "decoded_token": tok.token_str(t)}
               for r, (t, lp) in enumerate(alternatives)}
        row.setdefault(str(token_id), {"logprob": _lp(chosen), "rank": ranks.get(token_id),
                                       "decoded_token": tok.token_str(token_id)})
        out.append(row)
    return out


def chunk_body(kind: str, request_id: str, created: int, model: str, choices: list[dict],
               usage_obj: dict | None = None) -> dict:
    """One streamed chunk of either endpoint (``kind``: its ``object``), with usage if given."""
    out = {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices}
    if usage_obj is not None:
        out["usage"] = usage_obj
    return out


def usage(states: Sequence[RequestState], n: int) -> dict:
    """Prompt tokens once per prompt (choices of one prompt share it); completions summed; under a
    reasoning parser the reasoning tokens among them (vLLM's ``completion_tokens_details``)."""
    per_prompt = states[::n] if n > 0 else states
    prompt = sum(s.prompt_tokens for s in per_prompt)
    completion = sum(s.n_tokens for s in states)
    cached = sum(s.cached_tokens for s in per_prompt)
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if states and states[0].reasoning is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": sum(s.reasoning.count for s in states)}
    return out


def state_usage(state: RequestState) -> dict:
    return {
        "prompt_tokens": state.prompt_tokens,
        "completion_tokens": state.n_tokens,
        "total_tokens": state.prompt_tokens + state.n_tokens,
    }
