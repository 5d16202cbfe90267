"""What every tool-call parser shares: its output types and the streaming contract.

A parser is a state machine fed the model's detokenized text as it streams (``feed``), then told
that the text ended (``finish``). Each call returns a ``ParserOutput``: content text, and
tool-call deltas (a call's first delta carries its id and name, later ones argument fragments).
The machine reads the text one character at a time in effect, so what it emits depends only on
the text, never on how the detokenizer cut it into pieces: only the cut between fragments moves.

The non-streaming answer (``parse_complete``) is the same machine fed the whole text, so a
stream's concatenated fragments equal it by construction. The one difference: a call that breaks
after its name was streamed (arguments that stop being JSON, or text that ends mid-call) cannot
be taken back from a stream, so the stream keeps what it sent and the rest is content; the
non-streaming answer drops that call and returns its raw text as content instead.

Content: the text outside the calls. Once a call is parsed, runs of text that are only
whitespace (the newlines templates put around calls) are left out; with no call at all the text
is returned exactly as generated. Text a parser cannot make a call of is content too.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar


class CallSyntaxError(ValueError):
    """The text being read cannot be (the rest of) a tool call."""


def new_call_id() -> str:
    """vLLM's shape for tool call ids."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class CallDelta:
    """Part of one tool call: the first has ``id`` and ``name``; all may carry arguments text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ParserOutput:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.content and not self.calls

    def start_call(self, index: int, name: str) -> None:
        self.calls.append(CallDelta(index, "", new_call_id(), name))

    def add_arguments(self, index: int, text: str) -> None:
        if not text:
            return
        if self.calls and self.calls[-1].index == index:
            self.calls[-1].arguments += text  # fragments of one feed travel as one delta
        else:
            self.calls.append(CallDelta(index, text))

    def extend(self, other: ParserOutput) -> ParserOutput:
        self.content += other.content
        for d in other.calls:
            if d.name is None:
                self.add_arguments(d.index, d.arguments)
            else:
                self.calls.append(d)
        return self

    def to_openai_calls(self) -> list[dict]:
        """The chunk's ``delta.tool_calls``: a call's first delta names it, later ones extend it."""
        out = []
        for d in self.calls:
            if d.name is None:
                out.append({"index": d.index, "function": {"arguments": d.arguments}})
            else:
                out.append({"index": d.index, "id": d.id, "type": "function",
                            "function": {"name": d.name, "arguments": d.arguments}})
        return out


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedMessage:
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class Broken:
    """A call that broke after its name was streamed: its index, where in the content its raw
    text belongs, and that raw text (for the non-streaming answer)."""

    index: int
    at: int
    raw: str


class ToolParser(ABC):
    """Base of the parsers: output buffering, content bookkeeping, the broken-call record."""

    name: ClassVar[str]
    # vLLM decodes with special tokens kept for parsers whose call tags are special tokens.
    keeps_special_tokens: ClassVar[bool] = True
    # a choice that made a call finishes with "tool_calls" (serving_chat.tool_finish_reason)
    calls_finish: ClassVar[bool] = True

    def __init__(self) -> None:
        self._out = ParserOutput()
        self._content_len = 0
        self.started = 0  # calls whose first delta was emitted (the next call's index)
        self.completed = 0  # calls whose arguments closed
        self.broken: Broken | None = None

    def feed(self, text: str) -> ParserOutput:
        if text:
            self._consume(text)
        return self._take()

    def finish(self) -> ParserOutput:
        self._end()
        return self._take()

    @abstractmethod
    def _consume(self, text: str) -> None: ...

    @abstractmethod
    def _end(self) -> None: ...

    def _take(self) -> ParserOutput:
        out, self._out = self._out, ParserOutput()
        return out

    def _content(self, text: str) -> None:
        self._out.content += text
        self._content_len += len(text)

    def _start_call(self, name: str) -> int:
        index = self.started
        self.started += 1
        self._out.start_call(index, name)
        return index

    def _break(self, raw: str) -> None:
        self.broken = Broken(self.started - 1, self._content_len, raw)


def accumulate(outputs: list[ParserOutput]) -> ParsedMessage:
    """A stream's outputs folded into one message (content "" stays "" when there is no call)."""
    content = "".join(o.content for o in outputs)
    calls: dict[int, ToolCall] = {}
    for out in outputs:
        for d in out.calls:
            if d.name is not None:
                calls[d.index] = ToolCall(d.id or new_call_id(), d.name, d.arguments)
            else:
                calls[d.index].arguments += d.arguments
    return ParsedMessage(content if not calls else (content or None), list(calls.values()))


def parse_complete(parser: ToolParser, text: str) -> ParsedMessage:
    """The non-streaming answer: the whole text through the machine; a broken call becomes
    content again, where its text was."""
    outputs = [parser.feed(text), parser.finish()]
    broken = parser.broken
    if broken is None:
        return accumulate(outputs)
    content = "".join(o.content for o in outputs)
    content = content[: broken.at] + broken.raw + content[broken.at:]
    kept = [ParserOutput(calls=[d for d in o.calls if d.index != broken.index]) for o in outputs]
    message = accumulate(kept)
    message.content = content if not message.tool_calls else (content or None)
    return message
