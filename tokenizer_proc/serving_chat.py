"""POST /v1/chat/completions, streaming and not.

With a tool-call parser for the request (``tool_choice`` "auto" on a server started with
``--enable-auto-tool-choice --tool-call-parser NAME``, or a forced ``"required"`` / named
function whose grammar shaped the answer, see tool_choice.py), each choice's text
goes through its own parser: content deltas carry the text outside the calls, ``tool_calls``
deltas the calls (the first one of a call its ``index``, ``id``, ``type`` and ``function.name``,
later ones ``function.arguments`` fragments), text that may still become a call is held back,
and a choice that made a call finishes with ``"tool_calls"`` (vLLM's choice, also when the
length cap ended it). The non-streaming message has ``tool_calls`` and ``content`` (null when
only calls were made). ``parallel_tool_calls: false`` keeps only each choice's first call
(vLLM drops the others the same way, after parsing).

With ``--reasoning-parser`` (reasoning.py) the text goes through the reasoning parser first:
the think block becomes ``reasoning_content`` (and ``reasoning``, current vLLM's name for it),
and only the rest reaches the tool-call parser, as in vLLM. Streamed deltas carry reasoning
until the block ends, then content; the non-streaming message has both, content null when
empty. Usage counts every generated token, reasoning included.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from tokenizer_proc.context import Front, arrival, read_body
from tokenizer_proc.errors import decode_body
from tokenizer_proc.formatting import chat_logprobs, chunk_body, new_id, now_s, state_usage, usage
from tokenizer_proc.params import GenPlan, check_model
from tokenizer_proc.plan_chat import plan_chat
from tokenizer_proc.protocol import ChatCompletionRequest
from tokenizer_proc.reasoning import ReasoningParser, split_reasoning
from tokenizer_proc.request_state import Delta
from tokenizer_proc.serving_openai import error_event, respond, stop_reason
from tokenizer_proc.streaming import DONE_EVENT, ChoiceResult, RequestGroup, sse
from tokenizer_proc.tool_parsers import ParsedMessage, ToolParser, parse_complete

log = logging.getLogger("tandem.front")


def tool_finish_reason(reason: str | None, calls: int, parser: ToolParser) -> str | None:
    """vLLM's: "tool_calls" once a call was parsed, also when the length cap ended the answer; a
    named tool_choice keeps its reason (``calls_finish``), as OpenAI and vLLM do."""
    return "tool_calls" if calls and parser.calls_finish and reason in ("stop", "length") else reason


def reasoning_fields(text: str | None) -> dict:
    """SGLang and DeepSeek name it ``reasoning_content``, vLLM now ``reasoning``: both, same text."""
    return {"reasoning_content": text, "reasoning": text}


class ChatHandler:
    def __init__(self, front: Front, plan: GenPlan, group: RequestGroup, request_id: str):
        self.front, self.plan, self.group = front, plan, group
        self.id, self.created, self.model = request_id, now_s(), front.args.model_name
        self.parsers: dict[int, ToolParser] = {}  # streaming: one per choice
        self.reasoners: dict[int, ReasoningParser] = {}

    def chunk(self, choices: list[dict], usage_obj: dict | None = None) -> dict:
        return chunk_body("chat.completion.chunk", self.id, self.created, self.model, choices, usage_obj)

    def _echo(self) -> str:
        return self.plan.prompt_texts[0] if self.plan.echo else ""

    def _logprobs(self, token_ids, entries) -> dict | None:
        k = self.plan.top_logprobs
        return None if k is None else chat_logprobs(self.front.tok, token_ids, entries, k)

    # ------------------------------------------------------------------ streaming
    def _parser(self, index: int) -> ToolParser | None:
        if self.plan.tool_parser is None:
            return None
        if index not in self.parsers:
            self.parsers[index] = self.plan.tool_parser()
        return self.parsers[index]

    def _split(self, d: Delta) -> tuple[str, str]:
        """(reasoning, content) of one step's text; all content without a reasoning parser."""
        if self.plan.reasoning is None:
            return "", d.text
        parser = self.reasoners.get(d.state.index)
        if parser is None:  # one per choice, made on its first step (not a new one every step)
            parser = self.reasoners[d.state.index] = ReasoningParser(self.plan.reasoning)
        out = parser.feed(d.text)
        if d.finished:
            tail = parser.finish()
            out.reasoning, out.content = out.reasoning + tail.reasoning, out.content + tail.content
        return (out.reasoning if self.plan.include_reasoning else ""), out.content

    def _delta(self, d: Delta) -> tuple[dict, str | None]:
        """One engine step of one choice: the chunk's delta and finish_reason."""
        reasoning, text = self._split(d)
        delta, finish = self._content_delta(d, text)
        return ({**reasoning_fields(reasoning), **delta} if reasoning else delta), finish

    def _content_delta(self, d: Delta, text: str) -> tuple[dict, str | None]:
        parser = self._parser(d.state.index)
        if parser is None:
            return ({"content": text} if text else {}), d.finish_reason
        out = parser.feed(text)
        if d.finished:
            out.extend(parser.finish())
        if not self.plan.parallel_tool_calls:  # vLLM: the deltas of the first call only
            out.calls = [c for c in out.calls if c.index == 0]
        delta: dict = {"content": out.content} if out.content else {}
        if out.calls:
            delta["tool_calls"] = out.to_openai_calls()
        return delta, tool_finish_reason(d.finish_reason, parser.completed, parser)

    def _head(self) -> list[dict]:
        """The role chunk of every choice (as vLLM sends them), then the echoed prefill."""
        cont = self.plan.continuous_usage
        # continuous usage: every chunk has it, the role chunk too (0 completion tokens), as vLLM sends it
        chunks = [self.chunk([{"index": s.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}], state_usage(s) if cont else None) for s in self.group.states]
        if self.plan.echo:
            chunks += [self.chunk([{"index": s.index, "delta": {"content": self.plan.prompt_texts[0]},
                                    "logprobs": None, "finish_reason": None}], state_usage(s) if cont else None)
                       for s in self.group.states]
        return chunks

    async def events(self) -> AsyncIterator[bytes]:
        for head in self._head():
            yield sse(head)
        async for batch in self.group.deltas():
            for d in batch:
                if d.error is not None:
                    yield error_event(d)
                    yield DONE_EVENT
                    return
                delta, finish = self._delta(d)
                if not delta and not d.finished and self.plan.top_logprobs is None:
                    continue  # nothing visible yet (held-back text, a skipped token), as vLLM
                choice = {"index": d.state.index, "delta": delta, "logprobs": self._logprobs(d.token_ids, d.logprobs),
                          "finish_reason": finish, "stop_reason": stop_reason(self.front, d.state, d.stop_reason)}
                yield sse(self.chunk([choice], state_usage(d.state) if self.plan.continuous_usage else None))
        if self.plan.include_usage:
            yield sse(self.chunk([], usage(self.group.states, self.plan.n)))
        yield DONE_EVENT

    # ------------------------------------------------------------------ whole answers
    def _parsed(self, parser: ToolParser, text: str) -> ParsedMessage:
        try:
            return parse_complete(parser, text)
        except Exception:  # noqa: BLE001 - a parser bug must not cost the answer: plain text
            log.exception("tool-call parser %s failed; answering with plain text", parser.name)
            return ParsedMessage(text, [])

    def _message(self, r: ChoiceResult) -> tuple[dict, str | None]:
        text = "".join(r.text)
        if self.plan.reasoning is None:
            return self._content_message(text, r)
        reasoning, text = split_reasoning(ReasoningParser(self.plan.reasoning), text)
        message, finish = self._content_message(text, r)
        if reasoning is not None and not message["content"]:
            message["content"] = None  # vLLM: an answer that is all reasoning has null content
        message.update(reasoning_fields(reasoning if self.plan.include_reasoning else None))
        return message, finish

    def _content_message(self, text: str, r: ChoiceResult) -> tuple[dict, str | None]:
        if self.plan.tool_parser is None:
            return {"role": "assistant", "content": self._echo() + text}, r.finish_reason
        parser = self.plan.tool_parser()
        parsed = self._parsed(parser, text)
        if not self.plan.parallel_tool_calls:  # vLLM keeps the first call
            parsed.tool_calls = parsed.tool_calls[:1]
        content = self._echo() + (parsed.content or "")
        message = {"role": "assistant", "content": content if content or not parsed.tool_calls else None}
        if parsed.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
        return message, tool_finish_reason(r.finish_reason, len(parsed.tool_calls), parser)

    def body(self, results: list[ChoiceResult]) -> dict:
        choices = []
        for r in results:
            message, finish = self._message(r)
            choices.append({"index": r.state.index, "message": message,
                            "logprobs": self._logprobs(r.token_ids, r.logprobs), "finish_reason": finish,
                            "stop_reason": stop_reason(self.front, r.state, r.stop_reason)})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(self.group.states, self.plan.n)}


async def create_chat_completion(front: Front, request: Request) -> Response:
    t0 = arrival()
    req = decode_body(await read_body(request), ChatCompletionRequest)
    check_model(req.model, front.args.model_names)
    front.engine.check_accepting()
    plan = plan_chat(req, front.tok, front.chat_template_for(req), front.limits(), front.gen_defaults,
                     front.auto_tool_parser, front.args.reasoning_parser)
    request_id = new_id("chatcmpl")
    group = RequestGroup(front.engine, front.make_states(plan, request_id, t0))
    handler = ChatHandler(front, plan, group, request_id)
    return await respond(request, group, plan, handler.events, handler.body)
