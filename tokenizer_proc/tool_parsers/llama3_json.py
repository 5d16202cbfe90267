"""Llama 3.1 / 3.2 JSON tool calls: the whole answer is the call(s), optionally after the
``<|python_tag|>`` token, several separated by ``;``:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}

An answer that does not start (after whitespace) with ``{`` or the tag is plain content, as in
vLLM's streaming parser. A JSON object without ``parameters`` / ``arguments`` is not a call (a
JSON answer with a "name" field must stay content). Text after the calls that is not a further
call is content. ``<|python_tag|>`` is a special token and decoding skips it unless the request
keeps special tokens; either way the calls parse (vLLM keeps the default here too).
"""

from __future__ import annotations

from tokenizer_proc.tool_parsers.base import CallSyntaxError, ToolParser
from tokenizer_proc.tool_parsers.json_scan import CallObject

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    keeps_special_tokens = False

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"  # start | call | between | passthrough
        self.held = ""  # read, not emitted: leading whitespace, the tag, a separator
        self.prefix = ""  # what was held when the current call began
        self.body: CallObject | None = None
        self.raw: list[str] = []  # the current call's text (a list: calls can be long)
        self.index: int | None = None
        self.sent = 0

    def _consume(self, text: str) -> None:
        i = 0
        while i < len(text):
            if self.state == "passthrough":
                self._content(text[i:])
                return
            if getattr(self, "_" + self.state)(text[i]):
                i += 1

    def _end(self) -> None:
        if self.state == "call" and self.index is not None:
            self._break(self.prefix + "".join(self.raw))  # cut off mid-call
        elif self.state in ("start", "call"):
            self._content(self.held + self.prefix + "".join(self.raw))  # never a call: the text as it was
        self.held = self.prefix = ""
        self.raw = []
        self.state = "passthrough"

    def _pass(self, text: str) -> bool:
        """From here on everything is content; the current character is read again."""
        self._content(text)
        self.held = self.prefix = ""
        self.raw = []
        self.state = "passthrough"
        return False

    # ------------------------------------------------------------------ states
    def _start(self, c: str) -> bool:
        candidate = self.held + c
        rest = candidate.lstrip()
        if rest.startswith(PYTHON_TAG):
            rest = rest[len(PYTHON_TAG):].lstrip()
        elif rest and PYTHON_TAG.startswith(rest):
            rest = ""  # the tag's beginning
        if not rest:
            self.held = candidate
            return True
        return self._open(c) if rest == "{" else self._pass(self.held)

    def _open(self, c: str) -> bool:
        self.body, self.raw, self.index, self.sent = CallObject(require_args=True), [], None, 0
        self.prefix, self.held, self.state = self.held, "", "call"
        return self._call(c)

    def _call(self, c: str) -> bool:
        try:
            closed = self.body.push(c)
        except CallSyntaxError:
            if self.index is None:
                return self._pass(self.prefix + "".join(self.raw))
            self._break(self.prefix + "".join(self.raw))
            return self._pass("")
        self.raw.append(c)
        self._emit_call()
        if closed:
            self.completed += 1
            self.prefix, self.raw, self.state = "", [], "between"
        return True

    def _emit_call(self) -> None:
        if self.index is None:
            if not self.body.announceable:
                return
            self.index = self._start_call(self.body.name)  # its leading whitespace / tag is dropped
        if len(self.body.args) > self.sent:
            self._out.add_arguments(self.index, "".join(self.body.args[self.sent:]))
            self.sent = len(self.body.args)

    def _between(self, c: str) -> bool:
        """After a call: whitespace and one ';', then another call; anything else is content."""
        if c.isspace() or (c == ";" and ";" not in self.held):
            self.held += c
            return True
        return self._open(c) if c == "{" else self._pass(self.held)
