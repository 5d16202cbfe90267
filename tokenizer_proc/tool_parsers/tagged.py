"""Parsers whose calls sit between a start and an end tag, with free text around them
(Hermes' ``<tool_call>...</tool_call>``, Gemma 4's ``<|tool_call>...<tool_call|>``).

States: ``text`` (content; a tail that may be the start tag's beginning is held back, and so is
a run of whitespace until something else shows up in it), ``body`` (the call, read by the
format's ``CallBody``), ``end_tag`` (the call closed; whitespace, then the end tag), and
``passthrough`` (after a call broke mid-stream: the rest is content, unread).

A body that fails before its call was announced gives its text back as content, tags
included, and reading goes on after it. A call whose body closed stands even if the end tag
never comes (a model that stops right after it, or writes something else): what follows is text.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar, Protocol

from tokenizer_proc.stops import partial_suffix
from tokenizer_proc.tool_parsers.base import CallSyntaxError, ToolParser


class CallBody(Protocol):
    """Reads one call's body a character at a time (raising CallSyntaxError)."""

    name: str | None
    args: list[str]  # the arguments' JSON text so far, in fragments

    @property
    def announceable(self) -> bool: ...

    def push(self, c: str) -> bool:
        """True when this character closed the call."""


class TaggedCallParser(ToolParser):
    start_tag: ClassVar[str]
    end_tag: ClassVar[str]

    def __init__(self) -> None:
        super().__init__()
        self.state = "text"
        self.tag_hold = ""  # may be the beginning of the start tag
        self.ws_hold = ""  # whitespace of a run that has nothing else yet
        self.run_has_text = False
        self.body: CallBody | None = None
        self.raw: list[str] = []  # the current call's text since its start tag (a list: calls get long)
        self.ws_before = ""  # the whitespace-only run right before it
        self.index: int | None = None  # the current call's index once announced
        self.sent = 0  # argument fragments of the current call already emitted
        self.end_tail = ""

    @abstractmethod
    def _new_body(self) -> CallBody: ...

    # ------------------------------------------------------------------ driver
    def _consume(self, text: str) -> None:
        i = 0
        while i < len(text):
            if self.state == "text":
                i = self._text(text, i)
            elif self.state == "passthrough":
                self._content(text[i:])
                i = len(text)
            elif self._call_char(text[i]):
                i += 1  # else the state changed and the character is read again

    def _end(self) -> None:
        if self.state == "body":
            if self.index is None:
                self._plain(self.ws_before + "".join(self.raw))
            else:
                self._break(self.ws_before + "".join(self.raw))  # cut off mid-call
        self.state = "text"
        self._plain(self.tag_hold)
        if self.ws_hold and not self.started:
            self._content(self.ws_hold)  # no call: the text is kept exactly
        self.tag_hold = self.ws_hold = ""

    # ------------------------------------------------------------------ text
    def _text(self, text: str, i: int) -> int:
        buf = self.tag_hold + text[i:]
        k = buf.find(self.start_tag)
        if k < 0:
            keep = partial_suffix(buf, self.start_tag)
            self._plain(buf[: len(buf) - keep])
            self.tag_hold = buf[len(buf) - keep:]
            return len(text)
        self.tag_hold = ""
        self._plain(buf[:k])
        self._open_call()
        return len(text) - (len(buf) - k - len(self.start_tag))

    def _plain(self, text: str) -> None:
        """Text that is no tag: content, except that whitespace waits to see what follows it."""
        if not text:
            return
        if self.run_has_text:
            self._content(text)
        elif text.isspace():
            self.ws_hold += text
        else:
            self.run_has_text = True
            self._content(self.ws_hold + text)
            self.ws_hold = ""

    # ------------------------------------------------------------------ calls
    def _open_call(self) -> None:
        self.ws_before = "" if self.run_has_text else self.ws_hold
        self.ws_hold = ""
        self.raw, self.body, self.index, self.sent = [self.start_tag], self._new_body(), None, 0
        self.state = "body"

    def _call_char(self, c: str) -> bool:
        if self.state == "end_tag":
            return self._end_tag_char(c)
        try:
            closed = self.body.push(c)
        except CallSyntaxError:
            return self._fail()
        self.raw.append(c)
        self._emit_call()
        if closed:
            self.completed += 1
            self.state, self.end_tail = "end_tag", ""
        return True

    def _emit_call(self) -> None:
        body = self.body
        if self.index is None:
            if not body.announceable:
                return
            self.index = self._start_call(body.name)  # the whitespace before it is dropped
        if len(body.args) > self.sent:
            self._out.add_arguments(self.index, "".join(body.args[self.sent:]))
            self.sent = len(body.args)

    def _fail(self) -> bool:
        """The character just read breaks the call; it is read again in the new state."""
        if self.index is None:
            self.state = "text"
            self._plain(self.ws_before + "".join(self.raw))
        else:
            self._break(self.ws_before + "".join(self.raw))
            self.state = "passthrough"
        return False

    def _end_tag_char(self, c: str) -> bool:
        tail = self.end_tail + c
        if self.end_tag.startswith(tail.lstrip()):
            self.end_tail = tail
            if tail.lstrip() == self.end_tag:
                self._close_call()
            return True
        self._close_call()  # no end tag: the call stands, what follows is text
        self._consume(self.end_tail)
        return False

    def _close_call(self) -> None:
        self.state, self.body, self.run_has_text = "text", None, False
