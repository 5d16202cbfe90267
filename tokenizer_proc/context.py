"""What every HTTP handler needs, bundled once per process."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from starlette.requests import Request

from common.args import ServerArgs
from tokenizer_proc.chat_template import ChatTemplate, RequestTemplates
from tokenizer_proc.engine_client import EngineClient
from tokenizer_proc.errors import APIError, bad_request, check_content_type
from tokenizer_proc.metrics import Metrics
from tokenizer_proc.params import GenPlan, Limits
from tokenizer_proc.reasoning import ReasoningTokenCounter
from tokenizer_proc.request_state import RequestState
from tokenizer_proc.tokenizer import TextTokenizer

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # ServerArgs.max_request_body_bytes


@dataclass
class Front:
    args: ServerArgs
    tok: TextTokenizer
    template: ChatTemplate
    engine: EngineClient
    metrics: Metrics
    gen_defaults: dict = field(default_factory=dict)
    request_templates: RequestTemplates = field(init=False)

    def __post_init__(self) -> None:
        self.request_templates = RequestTemplates(self.tok)

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser for tool_choice "auto": only with --enable-auto-tool-choice and --tool-call-parser."""
        return self.args.tool_call_parser if self.args.enable_auto_tool_choice else None

    def chat_template_for(self, req) -> ChatTemplate:
        """The template a chat request renders with: the server's, or the request's own
        (``chat_template``, or ``chat_template_kwargs.chat_template`` as vLLM also reads it), which
        runs code the client wrote and so needs --trust-request-chat-template (vLLM's rule)."""
        source = getattr(req, "chat_template", None)
        if source is None:
            source = (getattr(req, "chat_template_kwargs", None) or {}).get("chat_template")
        if source is None:
            return self.template
        if not self.args.trust_request_chat_template:
            raise bad_request("chat_template: request chat templates are refused; start the server with "
                              "--trust-request-chat-template to allow them", "chat_template")
        if not isinstance(source, str):
            raise bad_request("chat_template: expected a string (a Jinja template)", "chat_template")
        try:
            return self.request_templates.get(source)
        except ValueError as exc:
            raise bad_request(f"chat_template: {exc}", "chat_template") from None

    def limits(self) -> Limits:
        info = self.engine.info
        if info is None:
            raise APIError(503, "server is starting up")
        return Limits(max_context=info.max_context, vocab_size=info.vocab_size)

    def make_states(self, plan: GenPlan, request_id: str, arrival_mono: float) -> list[RequestState]:
        """One engine request per (prompt, choice); choice index = prompt * n + j (OpenAI's order)."""
        states = []
        for p, prompt_ids in enumerate(plan.prompts):
            for j in range(plan.n):
                index = p * plan.n + j
                state = RequestState(f"{request_id}-{index}", index, prompt_ids, plan.choice_params(j),
                                     plan.stop_cfg, self.tok, arrival_mono=arrival_mono)
                if plan.reasoning is not None:
                    state.reasoning = ReasoningTokenCounter(plan.reasoning)
                states.append(state)
        return states


def _body_limit(request: Request) -> int:
    front = getattr(request.app.state, "front", None)
    return front.args.max_request_body_bytes if front is not None else DEFAULT_MAX_BODY_BYTES


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than {limit} bytes (--max-request-body-bytes)", retry_after=False)


async def read_body(request: Request) -> bytes:
    """The raw JSON body, after the Content-Type check; 413 past --max-request-body-bytes,
    whether the client declared the length or streams it chunked (counted as it arrives, so an
    oversized body is never held in memory)."""
    check_content_type(request.headers.get("content-type"))
    limit = _body_limit(request)
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def arrival() -> float:
    return time.monotonic()
