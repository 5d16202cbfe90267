"""SGLang-native and tokenizer endpoints: /generate, /tokenize, /detokenize, /health_generate.

/generate follows SGLang's shape so ``sglang.bench_serving --backend sglang`` runs against us:
``{text | input_ids, sampling_params, stream, return_logprob, rid}`` ->
``{text, meta_info: {id, finish_reason: {type, matched}, prompt_tokens, completion_tokens,
cached_tokens, e2e_latency, spec_verify_ct}}``; streaming sends the *cumulative* text in each
event (SGLang's default), then ``[DONE]``. One prompt per request (no batch lists).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from proto.messages import SamplingParams
from tokenizer_proc.context import Front, arrival, read_body
from tokenizer_proc.errors import APIError, bad_request, decode_body, error_body
from tokenizer_proc.formatting import new_id
from tokenizer_proc.params import (
    Limits,
    check_context,
    check_logit_bias,
    check_min_tokens,
    check_model,
    check_text_length,
    check_token_ids,
    encode_prompt,
    sampling_params,
    stop_strings,
)
from tokenizer_proc.plan_chat import chat_text
from tokenizer_proc.protocol import DetokenizeRequest, GenerateRequest, NativeSamplingParams, TokenizeRequest
from tokenizer_proc.request_state import RequestState, StopConfig, TokenLogprob
from tokenizer_proc.structured import request_grammar
from tokenizer_proc.streaming import (
    DONE_EVENT,
    ChoiceResult,
    ClientDisconnected,
    RequestGroup,
    SSEResponse,
    collect_or_abort,
    sse,
)

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
HEALTH_GENERATE_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class LogprobOpts:
    """What /generate returns besides text: nothing, or output (and prompt) logprobs."""

    enabled: bool = False
    top_k: int = 0
    prompt_start: int = -1  # SGLang's logprob_start_len: -1 none, else prompt tokens from here


def _logprob_opts(req: GenerateRequest) -> LogprobOpts:
    if not req.return_logprob:
        return LogprobOpts()
    start = -1 if req.logprob_start_len is None else req.logprob_start_len
    return LogprobOpts(True, req.top_logprobs_num or 0, start)


def _native_state(front: Front, req: GenerateRequest, limits: Limits, t0: float) -> RequestState:
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("exactly one of 'text' or 'input_ids' is required", "text")
    if req.text is not None:
        if not req.text:
            raise bad_request("text must not be empty", "text")
        ids = encode_prompt(req.text, front.tok, limits, "text")
    else:
        ids = list(req.input_ids or [])
        if not ids:
            raise bad_request("input_ids must not be empty", "input_ids")
        check_token_ids(ids, limits, "input_ids")
    sp = req.sampling_params or NativeSamplingParams()
    if sp.max_new_tokens is None:
        # SGLang's default, cut to what the context has room for (as SGLang does); only an
        # explicit max_new_tokens that cannot fit is an error.
        max_new = max(1, min(SGLANG_DEFAULT_MAX_NEW_TOKENS, limits.max_context - len(ids)))
    else:
        max_new = sp.max_new_tokens
    check_context(len(ids), max_new, limits, "sampling_params.max_new_tokens")
    check_min_tokens(sp.min_new_tokens, max_new, "sampling_params.min_new_tokens")
    if sp.stop_token_ids:
        check_token_ids(sp.stop_token_ids, limits, "sampling_params.stop_token_ids")
    check_logit_bias(sp.logit_bias, limits, "sampling_params.logit_bias")
    lp = _logprob_opts(req)
    k = lp.top_k if lp.enabled else -1
    # logprob_start_len -1 (SGLang's default): output logprobs only; >= 0 adds the prompt's.
    prompt_k = k if lp.enabled and lp.prompt_start >= 0 else -1
    seed = sp.sampling_seed if sp.sampling_seed is not None else sp.seed
    params = sampling_params(sp, max(1, max_new), front.gen_defaults, k, prompt_k, sp.min_new_tokens, seed,
                             request_grammar(sp, "sampling_params."))
    cfg = StopConfig(stop_strings(sp.stop), bool(sp.no_stop_trim), sp.skip_special_tokens is not False,
                     discard_generation=max_new == 0)
    return RequestState(req.rid or new_id("gen"), 0, ids, params, cfg, front.tok, arrival_mono=t0)


def _finish_reason(reason: str | None, stop: str | int | None, state: RequestState) -> dict | None:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": state.n_tokens}
    if reason == "stop":
        return {"type": "stop", "matched": stop}
    return {"type": reason}


def _logprob_triples(ids: list[int], entries: list[TokenLogprob]) -> list:
    return [[entries[i][0] if i < len(entries) else None, t, None] for i, t in enumerate(ids)]


def _top_triples(entries: list[TokenLogprob | None], k: int) -> list:
    """SGLang's ``*_top_logprobs``: per position, the top-k as [logprob, token id, None]."""
    return [None if e is None else [[lp, t, None] for t, lp in e[1][:k]] for e in entries]


def _meta(state: RequestState, reason: str | None, stop, ids: list[int], entries, lp: LogprobOpts) -> dict:
    meta = {
        "id": state.rid,
        "finish_reason": _finish_reason(reason, stop, state),
        "prompt_tokens": state.prompt_tokens,
        "completion_tokens": state.n_tokens,
        "cached_tokens": state.cached_tokens,
        "e2e_latency": time.monotonic() - state.arrival_mono,
        "spec_verify_ct": state.spec_verify_ct,
    }
    if lp.enabled:
        meta["output_token_logprobs"] = _logprob_triples(ids, entries)
        if lp.top_k > 0:
            meta["output_top_logprobs"] = _top_triples(list(entries[: len(ids)]), lp.top_k)
        if state.prompt_logprobs is not None and lp.prompt_start >= 0:
            prompt = [None, *state.prompt_logprobs][lp.prompt_start: len(state.prompt_ids)]
            ids_from = state.prompt_ids[lp.prompt_start:]
            meta["input_token_logprobs"] = [[None if e is None else e[0], t, None]
                                            for e, t in zip(prompt, ids_from, strict=False)]
            if lp.top_k > 0:
                meta["input_top_logprobs"] = _top_triples(prompt, lp.top_k)
    return meta


async def _native_events(group: RequestGroup, lp: LogprobOpts) -> AsyncIterator[bytes]:
    result = ChoiceResult(group.states[0])
    async for batch in group.deltas():
        for d in batch:
            if d.error is not None:
                yield sse(error_body(d.error_code or 500, d.error))
                yield DONE_EVENT
                return
            result.add(d)
            meta = _meta(d.state, d.finish_reason, d.stop_reason, result.token_ids, result.logprobs, lp)
            yield sse({"text": "".join(result.text), "output_ids": result.token_ids, "meta_info": meta, "index": 0})
    yield DONE_EVENT


async def generate(front: Front, request: Request) -> Response:
    t0 = arrival()
    req = decode_body(await read_body(request), GenerateRequest)
    front.engine.check_accepting()
    state = _native_state(front, req, front.limits(), t0)
    group = RequestGroup(front.engine, [state])
    lp = _logprob_opts(req)
    if req.stream:
        return SSEResponse(_native_events(group, lp), on_close=group.close)
    try:
        (r,) = await collect_or_abort(request, group)
    except ClientDisconnected:
        return Response(status_code=499)
    if r.error is not None:
        raise APIError(r.error_code or 500, r.error)
    meta = _meta(r.state, r.finish_reason, r.stop_reason, r.token_ids, r.logprobs, lp)
    return JSONResponse({"text": "".join(r.text), "output_ids": r.token_ids, "meta_info": meta})


# ---------------------------------------------------------------------- tokenizer endpoints


async def tokenize(front: Front, request: Request) -> Response:
    req = decode_body(await read_body(request), TokenizeRequest)
    check_model(req.model, front.args.model_names)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("exactly one of 'prompt' or 'messages' is required", "prompt")
    info = front.engine.info
    max_context = info.max_context if info else front.args.context_length
    if req.messages is not None:
        # vLLM: special tokens off by default for chats; the template writes them itself.
        template = front.chat_template_for(req)
        text, add_special, param = chat_text(req, template), bool(req.add_special_tokens), "messages"
    else:
        text, add_special, param = req.prompt or "", req.add_special_tokens is not False, "prompt"
    if max_context:
        check_text_length(text, front.tok, max_context, param)
    ids = front.tok.encode(text, add_special_tokens=add_special)
    body = {"count": len(ids), "max_model_len": info.max_context if info else front.args.context_length,
            "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = front.tok.convert_ids_to_tokens(ids)
    return JSONResponse(body)


async def detokenize(front: Front, request: Request) -> Response:
    req = decode_body(await read_body(request), DetokenizeRequest)
    check_model(req.model, front.args.model_names)
    info = front.engine.info
    vocab = info.vocab_size if info else front.tok.vocab_size
    check_token_ids(req.tokens, Limits(max_context=0, vocab_size=vocab), "tokens")
    return JSONResponse({"prompt": front.tok.decode(req.tokens, skip_special_tokens=False)})


# ---------------------------------------------------------------------- probes


def probe_prompt(front: Front) -> list[int]:
    """A few real tokens (all below the engine's vocabulary) for warm-up and health probes."""
    vocab = front.engine.info.vocab_size if front.engine.info else front.tok.vocab_size
    ids = [t for t in front.tok.encode("Hello, world", add_special_tokens=True) if 0 <= t < vocab]
    return ids[:4] or [0]


async def run_probe(front: Front, max_new_tokens: int, timeout: float | None) -> ChoiceResult:
    """One greedy internal request through the whole engine loop (no metrics, no queue limit)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    state = RequestState(new_id("probe"), 0, probe_prompt(front), params, StopConfig(), front.tok, internal=True)
    group = RequestGroup(front.engine, [state], internal=True)
    try:
        (result,) = await asyncio.wait_for(group.collect(), timeout)
        return result
    finally:
        group.close("client_disconnect")


async def health_generate(front: Front, request: Request) -> Response:
    if front.engine.phase != "ready":
        return JSONResponse(error_body(503, f"server is {front.engine.phase}"), status_code=503)
    try:
        result = await run_probe(front, 1, HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        return JSONResponse(error_body(503, "engine did not answer within 20 s"), status_code=503)
    except APIError as err:
        return JSONResponse(err.body(), status_code=503)
    if result.error is not None:
        return JSONResponse(error_body(503, result.error), status_code=503)
    return Response(status_code=200)
