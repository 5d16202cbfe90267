"""What ``LLM.generate`` and ``LLM.chat`` return: vLLM's ``RequestOutput`` / ``CompletionOutput``
/ ``Logprob`` field names, built from the front's per-request state (``RequestState``) and the
choice it accumulated (``ChoiceResult``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tokenizer_proc.formatting import openai_stop_reason
from tokenizer_proc.request_state import RequestState, TokenLogprob
from tokenizer_proc.streaming import ChoiceResult
from tokenizer_proc.tokenizer import TextTokenizer


@dataclass(frozen=True)
class Logprob:
    """One token's log probability; ``rank`` 1 is the most likely token (None: the sampled token
    was not among the top alternatives asked for, so its rank is unknown)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class RequestMetrics:
    """Wall-clock times (``time.time()``) of one prompt's request and the scheduler's queue time."""

    arrival_time: float
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float
    time_in_queue: float | None  # received by the scheduler -> first scheduled (seconds)
    num_generation_tokens: int

    @property
    def first_token_latency(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: str | int | None = None  # the stop string or stop token id (None: EOS)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0


def logprob_row(tok: TextTokenizer, token_id: int, entry: TokenLogprob) -> dict[int, Logprob]:
    """{token id: Logprob} for the chosen token and its top alternatives (ranks from 1)."""
    chosen, alternatives = entry
    row = {t: Logprob(lp, r + 1, tok.token_str(t)) for r, (t, lp) in enumerate(alternatives)}
    if token_id not in row:
        row[token_id] = Logprob(chosen, None, tok.token_str(token_id))
    return row


def sample_logprobs(tok: TextTokenizer, token_ids: Sequence[int],
                    entries: Sequence[TokenLogprob]) -> list[dict[int, Logprob]]:
    return [logprob_row(tok, t, e) for t, e in zip(token_ids, entries)]


def prompt_logprobs(tok: TextTokenizer, state: RequestState) -> list[dict[int, Logprob] | None]:
    """vLLM's shape: None for the first prompt token (nothing predicts it), then one row each."""
    rows = state.prompt_logprobs or []
    ids = list(state.prompt_ids)
    return [None] + [logprob_row(tok, t, rows[i]) if i < len(rows) else None for i, t in enumerate(ids[1:])]


def completion_output(tok: TextTokenizer, result: ChoiceResult, want_logprobs: bool) -> CompletionOutput:
    """``stop_reason`` as the HTTP API reports it (None for the tokenizer's EOS, as vLLM)."""
    logprobs = sample_logprobs(tok, result.token_ids, result.logprobs) if want_logprobs else None
    return CompletionOutput(
        index=result.state.index,
        text="".join(result.text),
        token_ids=list(result.token_ids),
        cumulative_logprob=sum(lp for lp, _ in result.logprobs) if want_logprobs else None,
        logprobs=logprobs,
        finish_reason=result.finish_reason,
        stop_reason=openai_stop_reason(result.stop_reason, result.state.params, tok.eos_id),
    )


def request_metrics(states: Sequence[RequestState], finished_time: float) -> RequestMetrics:
    """Over every choice of one prompt: its first token is the first of any choice."""
    first = states[0]
    to_wall = first.arrival_wall - first.arrival_mono
    firsts = [s.first_token_mono for s in states if s.first_token_mono is not None]
    lasts = [s.last_token_mono for s in states if s.last_token_mono is not None]
    queued = [s.timings.queue_s for s in states if s.timings is not None]
    return RequestMetrics(
        arrival_time=first.arrival_wall,
        first_token_time=min(firsts) + to_wall if firsts else None,
        last_token_time=max(lasts) + to_wall if lasts else None,
        finished_time=finished_time,
        time_in_queue=min(queued) if queued else None,
        num_generation_tokens=sum(s.n_tokens for s in states),
    )
