"""POST /v1/completions, streaming and not, and what the chat endpoint (serving_chat.py) shares.

Streaming sends one SSE event per choice per engine step (deltas a slow reader missed are
coalesced), ``choices[].index`` telling ``n`` > 1 choices apart; ``stream_options.include_usage``
adds a last chunk with ``"choices": []`` and the usage; an error after the 200 is an event
``{"error": {...}}`` followed by ``[DONE]``.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator, Callable

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from tokenizer_proc.context import Front, arrival, read_body
from tokenizer_proc.errors import APIError, decode_body, error_body
from tokenizer_proc.formatting import (
    CompletionLogprobs,
    chunk_body,
    new_id,
    now_s,
    openai_stop_reason,
    state_usage,
    usage,
    vllm_prompt_logprobs,
)
from tokenizer_proc.params import GenPlan, check_model, plan_completion
from tokenizer_proc.protocol import CompletionRequest
from tokenizer_proc.request_state import Delta, RequestState
from tokenizer_proc.streaming import (
    DONE_EVENT,
    ChoiceResult,
    ClientDisconnected,
    RequestGroup,
    SSEResponse,
    collect_or_abort,
    sse,
)

log = logging.getLogger("tandem.front")


def raise_on_error(results: list[ChoiceResult]) -> None:
    for r in results:
        if r.error is not None:
            raise APIError(r.error_code or 500, r.error)


def error_event(d: Delta) -> bytes:
    return sse(error_body(d.error_code or 500, d.error or "engine error"))


def stop_reason(front: Front, state: RequestState, matched: str | int | None) -> str | int | None:
    return openai_stop_reason(matched, state.params, front.tok.eos_id)


def _silent(d: Delta, top_logprobs: int | None) -> bool:
    """A step that produced no visible text (a skipped special token, held-back bytes) and
    carries nothing else worth an event: skip it, as vLLM does."""
    return not d.text and not d.finished and top_logprobs is None


async def _guarded(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A bug while streaming still ends the stream properly: error event, then [DONE]."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # noqa: BLE001
        log.exception("streaming response failed")
        yield sse(error_body(500, f"internal error: {type(exc).__name__}: {exc}"))
        yield DONE_EVENT


async def respond(request: Request, group: RequestGroup, plan: GenPlan,
                  events: Callable[[], AsyncIterator[bytes]], body: Callable[[list[ChoiceResult]], dict]) -> Response:
    if plan.stream:
        return SSEResponse(_guarded(events()), on_close=group.close)
    try:
        results = await collect_or_abort(request, group)
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; the engine requests are aborted
    raise_on_error(results)
    return JSONResponse(body(results))


# ---------------------------------------------------------------------- completions


class CompletionHandler:
    def __init__(self, front: Front, plan: GenPlan, group: RequestGroup, request_id: str):
        self.front, self.plan, self.group = front, plan, group
        self.id, self.created, self.model = request_id, now_s(), front.args.model_name
        self.k = plan.top_logprobs
        self.lp: dict[int, CompletionLogprobs] = {}

    def _prompt_text(self, state: RequestState) -> str:
        return self.plan.prompt_texts[state.index // self.plan.n]

    def _logprobs_acc(self, state: RequestState) -> CompletionLogprobs:
        acc = self.lp.get(state.index)
        if acc is None:
            acc = self.lp[state.index] = CompletionLogprobs(self.front.tok, self.k or 0)
            if self.plan.echo:
                acc.add_prompt(state.prompt_ids, state.prompt_logprobs)
        return acc

    def _logprobs_part(self, state: RequestState, token_ids, entries) -> dict | None:
        """The logprobs of just these tokens (plus the prompt's on a choice's first echo)."""
        if self.k is None:
            return None
        first = state.index not in self.lp
        acc = self._logprobs_acc(state)
        start = 0 if first else len(acc.tokens)
        acc.add(token_ids, entries)
        return {key: value[start:] for key, value in acc.to_dict().items()}

    def chunk(self, choices: list[dict], usage_obj: dict | None = None) -> dict:
        return chunk_body("text_completion", self.id, self.created, self.model, choices, usage_obj)

    async def events(self) -> AsyncIterator[bytes]:
        echoed: set[int] = set()
        async for batch in self.group.deltas():
            for d in batch:
                if d.error is not None:
                    yield error_event(d)
                    yield DONE_EVENT
                    return
                if _silent(d, self.k):
                    continue
                text = d.text
                if self.plan.echo and d.state.index not in echoed:
                    echoed.add(d.state.index)
                    text = self._prompt_text(d.state) + text
                choice = {"index": d.state.index, "text": text,
                          "logprobs": self._logprobs_part(d.state, d.token_ids, d.logprobs),
                          "finish_reason": d.finish_reason,
                          "stop_reason": stop_reason(self.front, d.state, d.stop_reason)}
                yield sse(self.chunk([choice], state_usage(d.state) if self.plan.continuous_usage else None))
        if self.plan.include_usage:
            yield sse(self.chunk([], usage(self.group.states, self.plan.n)))
        yield DONE_EVENT

    def body(self, results: list[ChoiceResult]) -> dict:
        choices = []
        for r in results:
            text = "".join(r.text)
            logprobs = None
            if self.k is not None:
                acc = self._logprobs_acc(r.state)
                acc.add(r.token_ids, r.logprobs)
                logprobs = acc.to_dict()
            if self.plan.echo:
                text = self._prompt_text(r.state) + text
            choice = {"index": r.state.index, "text": text, "logprobs": logprobs,
                      "finish_reason": r.finish_reason, "stop_reason": stop_reason(self.front, r.state, r.stop_reason)}
            if self.plan.return_prompt_logprobs:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(self.front.tok, r.state.prompt_ids,
                                                                 r.state.prompt_logprobs)
            choices.append(choice)
        out = self.chunk(choices)
        out["usage"] = usage(self.group.states, self.plan.n)
        return out


async def create_completion(front: Front, request: Request) -> Response:
    t0 = arrival()
    req = decode_body(await read_body(request), CompletionRequest)
    check_model(req.model, front.args.model_names)
    front.engine.check_accepting()
    plan = plan_completion(req, front.tok, front.limits(), front.gen_defaults)
    request_id = new_id("cmpl")
    group = RequestGroup(front.engine, front.make_states(plan, request_id, t0))
    handler = CompletionHandler(front, plan, group, request_id)
    return await respond(request, group, plan, handler.events, handler.body)
