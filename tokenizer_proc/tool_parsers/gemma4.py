"""Gemma 4 tool calls: its own notation between special tokens, not JSON,

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,units:[<|"|>C<|"|>]}<tool_call|>

(the published chat template writes assistant calls this way: ``format_argument``). Keys are
bare words (or quoted), strings sit between ``<|"|>`` tokens and are not escaped, numbers and
``true``/``false``/``null`` are bare, objects and arrays use ``{}``/``[]``. Several calls follow
one another; text around them is content. The tokens are special, so they are kept when decoding
(as vLLM's gemma4 parser asks).

The arguments are translated to JSON as they stream: ``{"city": "Paris", "days": 3, ...}``,
with ``json.dumps``' separators and escaping. A bare value is written once it ended (``3`` may
still become ``3.5``): as a number when it is one (and JSON can hold it: ``1e999`` and ints
longer than ``int()`` reads stay text, as vLLM's parser leaves them), ``true``/``false``/``null``
(``None`` and ``nil`` too, as vLLM reads them), else as a string.
"""

from __future__ import annotations

import json
import math
import re

from tokenizer_proc.stops import partial_suffix
from tokenizer_proc.tool_parsers.base import CallSyntaxError
from tokenizer_proc.tool_parsers.tagged import CallBody, TaggedCallParser

QUOTE = '<|"|>'
_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"-?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?")
_NULLS = ("null", "none", "nil")


def bare_json(token: str) -> str:
    """A bare value as JSON text."""
    if token in ("true", "false"):
        return token
    if token.lower() in _NULLS:
        return "null"
    if _INT.fullmatch(token):
        try:
            return json.dumps(int(token))
        except ValueError:  # more digits than int() reads (sys.get_int_max_str_digits): text, as vLLM
            return json.dumps(token)
    if _FLOAT.fullmatch(token) and math.isfinite(float(token)):
        return json.dumps(float(token))
    return json.dumps(token, ensure_ascii=False)  # 1e999 too: json.dumps would write Infinity


class GemmaCallBody:
    """``call:NAME{...}`` a character at a time, the arguments translated to JSON."""

    def __init__(self) -> None:
        self.mode = "prefix"
        self.buf = ""  # the word being read: "call:", the name, a key, a bare value, a quote's start
        self.name: str | None = None
        self.args: list[str] = []
        self.stack: list[str] = []
        self.empty_ok = False

    @property
    def announceable(self) -> bool:
        return bool(self.args)

    def push(self, c: str) -> bool:
        return getattr(self, "_" + self.mode)(c)

    def _fail(self, why: str) -> bool:
        raise CallSyntaxError(why)

    # ------------------------------------------------------------------ call:NAME{
    def _prefix(self, c: str) -> bool:
        if not self.buf and c.isspace():
            return False
        self.buf += c
        if not "call:".startswith(self.buf):
            return self._fail("a Gemma 4 call starts with 'call:'")
        if self.buf == "call:":
            self.mode, self.buf = "name", ""
        return False

    def _name(self, c: str) -> bool:
        if c == "{" and self.buf:
            self.name, self.buf = self.buf, ""
            return self._open("{")
        if not (c.isalnum() or c in "_-."):
            return self._fail(f"unexpected {c!r} in a function name")
        self.buf += c
        return False

    # ------------------------------------------------------------------ structure
    def _open(self, c: str) -> bool:
        self.args.append(c)
        self.stack.append(c)
        self.mode, self.empty_ok, self.buf = ("key" if c == "{" else "value"), True, ""
        return False

    def _close(self, c: str) -> bool:
        if not self.stack or self.stack[-1] != ("{" if c == "}" else "["):
            return self._fail(f"mismatched {c!r}")
        self.stack.pop()
        self.args.append(c)
        self.mode, self.empty_ok = ("after" if self.stack else "done"), False
        return not self.stack  # the arguments object closed: so did the call

    def _key(self, c: str) -> bool:
        """A bare key (no brackets, commas or newlines: a malformed call must not swallow the
        text after it) or one between quote tokens, then ':'."""
        if not self.buf and c.isspace():
            return False
        if not self.buf and c == "}" and self.empty_ok:
            return self._close(c)
        if c == ":" and self._key_text() is not None:
            self.args.append(json.dumps(self._key_text(), ensure_ascii=False) + ": ")
            self.mode, self.buf, self.empty_ok = "value", "", False
            return False
        self.buf += c
        if self.buf.startswith("<"):
            return self._quoted_key()
        if c in "{}[],<>\n":
            return self._fail(f"unexpected {c!r} in a key")
        return False

    def _quoted_key(self) -> bool:
        if not self.buf.startswith(QUOTE):
            return False if QUOTE.startswith(self.buf) else self._fail("a key starting with '<'")
        inner = self.buf[len(QUOTE):]
        end = inner.find(QUOTE)
        if end >= 0 and inner[end + len(QUOTE):].strip():
            return self._fail("text after a quoted key")
        return False

    def _key_text(self) -> str | None:
        """The key read so far if it is complete, else None."""
        key = self.buf.strip()
        if key.startswith("<"):
            quoted = key.startswith(QUOTE) and key.endswith(QUOTE) and len(key) >= 2 * len(QUOTE)
            return key[len(QUOTE):-len(QUOTE)] if quoted else None
        return key or None

    def _value(self, c: str) -> bool:
        if not self.buf:
            if c.isspace():
                return False
            if c in "{[":
                return self._open(c)
            if c == "]" and self.empty_ok and self.stack[-1] == "[":
                return self._close(c)
        self.empty_ok = False
        self.buf += c
        if self.buf == QUOTE:
            self.args.append('"')
            self.mode, self.buf = "string", ""
        elif not QUOTE.startswith(self.buf):
            held, self.mode, self.buf = self.buf, "bare", ""  # "<" that opened no quote: a bare value
            return self._bare_text(held)
        return False

    def _string(self, c: str) -> bool:
        self.buf += c
        if self.buf.endswith(QUOTE):
            text = self.buf[: -len(QUOTE)]
            self.args.append(json.dumps(text, ensure_ascii=False)[1:-1] + '"')
            self.mode, self.buf = "after", ""
            return False
        keep = partial_suffix(self.buf, QUOTE)
        ready = self.buf[: len(self.buf) - keep]
        if ready:
            self.args.append(json.dumps(ready, ensure_ascii=False)[1:-1])
            self.buf = self.buf[len(ready):]
        return False

    def _bare(self, c: str) -> bool:
        if c in ",}]":
            token = self.buf.strip()
            if not token:
                return self._fail("a value is missing")
            self.args.append(bare_json(token))
            self.mode, self.buf = "after", ""
            return self._after(c)
        self.buf += c
        return False

    def _bare_text(self, text: str) -> bool:
        closed = False
        for ch in text:
            closed = self._bare(ch)
        return closed

    def _after(self, c: str) -> bool:
        if c.isspace():
            return False
        if c == ",":
            self.args.append(", ")
            self.mode = "key" if self.stack[-1] == "{" else "value"
            return False
        if c in "}]":
            return self._close(c)
        return self._fail(f"expected ',' or a closing bracket, got {c!r}")

    def _done(self, c: str) -> bool:
        return self._fail("text after the call")


class Gemma4Parser(TaggedCallParser):
    name = "gemma4"
    start_tag = "<|tool_call>"
    end_tag = "<tool_call|>"

    def _new_body(self) -> CallBody:
        return GemmaCallBody()
