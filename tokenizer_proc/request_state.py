"""Per-request state in the front: turns the engine's ReqOutputs into text Deltas.

One RequestState per engine request (a choice of an HTTP request: ``n`` > 1 makes several).
``apply`` walks the new tokens of a ReqOutput *one token at a time* — detokenize, then stop-string
check — so a stop that completes in the middle of a multi-token (speculative) chunk cuts there:
text, token ids, logprobs and usage all end at the token that completed the stop, and the
tokens after it are dropped as if never generated.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Sequence

from proto.arrays import unpack_f32, unpack_i32
from proto.messages import Logprobs, ReqOutput, SamplingParams
from tokenizer_proc.detokenize import Decoder, IncrementalDetokenizer
from tokenizer_proc.reasoning import ReasoningTokenCounter
from tokenizer_proc.stops import StopMatch, StopMatcher

# (chosen-token logprob, [(alternative id, logprob), ...]) for one token.
TokenLogprob = tuple[float, list[tuple[int, float]]]


def unpack_logprobs(lp: Logprobs | None) -> list[TokenLogprob]:
    if lp is None:
        return []
    chosen = unpack_f32(lp.token_logprobs)
    if lp.top <= 0:
        return [(c, []) for c in chosen]
    ids, lps, k = unpack_i32(lp.top_ids), unpack_f32(lp.top_logprobs), lp.top
    return [(c, list(zip(ids[i * k:(i + 1) * k], lps[i * k:(i + 1) * k], strict=True))) for i, c in enumerate(chosen)]


@dataclass
class Delta:
    """What one engine step added to one choice, already cut at any stop."""

    state: RequestState
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None  # the stop string or stop token id
    error: str | None = None
    error_code: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StopConfig:
    stop: Sequence[str] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # echo with max_tokens=0: the engine generates one token we must not show (see params.py).
    discard_generation: bool = False


class RequestState:
    def __init__(
        self,
        rid: str,
        index: int,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        stop_cfg: StopConfig,
        decoder: Decoder,
        arrival_mono: float | None = None,
        internal: bool = False,
    ):
        self.rid = rid
        self.index = index
        self.prompt_ids = prompt_ids
        self.params = params
        self.cfg = stop_cfg
        self.internal = internal  # warm-up / health probes: no metrics
        self.sink: asyncio.Queue | None = None  # set by EngineClient.submit
        self.detok = IncrementalDetokenizer(decoder, prompt_ids, stop_cfg.skip_special_tokens)
        self.matcher = StopMatcher(stop_cfg.stop, stop_cfg.include_stop_str_in_output)
        self.arrival_mono = time.monotonic() if arrival_mono is None else arrival_mono
        # The HTTP arrival on the wall clock, for the scheduler's queue timing.
        self.arrival_wall = time.time() - (time.monotonic() - self.arrival_mono)
        self.first_token_mono: float | None = None
        self.last_token_mono: float | None = None
        self.n_tokens = 0  # completion tokens kept (usage)
        self.reasoning: ReasoningTokenCounter | None = None  # chat under --reasoning-parser (usage)
        self.prompt_tokens = len(prompt_ids)
        self.cached_tokens = 0
        self.spec_verify_ct = 0
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self.finished = False
        self.finish_reason: str | None = None
        self.timings = None

    # ------------------------------------------------------------------ engine outputs
    def _update_meta(self, out: ReqOutput) -> None:
        if out.prompt_tokens:
            self.prompt_tokens = out.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        self.spec_verify_ct = max(self.spec_verify_ct, out.spec_verify_ct)
        if out.prompt_logprobs is not None:
            # Chunked prefill sends them in several outputs, in prompt order.
            self.prompt_logprobs = (self.prompt_logprobs or []) + unpack_logprobs(out.prompt_logprobs)
        if out.timings is not None:
            self.timings = out.timings

    def _hidden_stop_token(self, token: int, out: ReqOutput, is_last: bool) -> bool:
        """An EOS / stop_token_ids token that ended the request: counted, but its text is not
        shown unless include_stop_str_in_output (vLLM's behaviour)."""
        return (
            is_last
            and out.finish_reason == "stop"
            and out.matched_stop is not None
            and token == out.matched_stop
            and not self.cfg.include_stop_str_in_output
        )

    def apply(self, out: ReqOutput) -> Delta | None:
        """Fold one ReqOutput in; None once the request has finished (late outputs are dropped)."""
        if self.finished:
            return None
        self._update_meta(out)
        if out.finish_reason == "error":
            return self.fail(out.error or "engine error", out.error_code or 500)
        if self.cfg.discard_generation:
            return self._finish(Delta(self), "length") if out.finish_reason else None
        delta = Delta(self)
        self._consume_tokens(out, delta)
        if delta.finish_reason is None and out.finish_reason is not None:
            self._finish_on_engine(out, delta)
        if delta.finish_reason is not None:
            self._finish(delta, delta.finish_reason)
        return delta if (delta.text or delta.token_ids or delta.finished) else None

    def _consume_tokens(self, out: ReqOutput, delta: Delta) -> None:
        ids = unpack_i32(out.token_ids)
        logprobs = unpack_logprobs(out.logprobs)
        texts: list[str] = []
        for i, token in enumerate(ids):
            self.n_tokens += 1
            delta.token_ids.append(token)
            if i < len(logprobs):
                delta.logprobs.append(logprobs[i])
            if self._hidden_stop_token(token, out, i == len(ids) - 1):
                continue
            allow = self.n_tokens >= self.params.min_new_tokens
            piece = self.detok.add(token)
            if self.reasoning is not None:
                self.reasoning.feed(piece)
            result = self.matcher.feed(piece, allow_match=allow)
            if isinstance(result, StopMatch):
                texts.append(result.emit)
                delta.finish_reason, delta.stop_reason = "stop", result.stop
                break
            texts.append(result)
        delta.text = "".join(texts)

    def _finish_on_engine(self, out: ReqOutput, delta: Delta) -> None:
        """The engine finished the request: release held-back text (it may still complete a stop)."""
        result = self.matcher.feed(self.detok.flush())
        if isinstance(result, StopMatch):
            delta.text += result.emit
            delta.finish_reason, delta.stop_reason = "stop", result.stop
            return
        delta.text += result + self.matcher.flush()
        delta.finish_reason = out.finish_reason
        delta.stop_reason = out.matched_stop

    def _finish(self, delta: Delta, reason: str) -> Delta:
        delta.finish_reason = reason
        self.finished = True
        self.finish_reason = reason
        return delta

    # ------------------------------------------------------------------ front-side endings
    def fail(self, message: str, code: int) -> Delta:
        """End with an error (engine error, engine death, shutdown)."""
        delta = Delta(self, error=message, error_code=code)
        return self._finish(delta, "error")

    def abort(self) -> Delta:
        return self._finish(Delta(self), "abort")

    @property
    def stopped_by_string(self) -> bool:
        return self.matcher.matched is not None
