"""JSON read one character at a time: enough to stream a tool call's arguments as they arrive
and to know, at the first character that breaks them, that they are not JSON.

``JsonValue`` checks one value against RFC 8259 and hands back each character's text: the
character itself, except a raw control character inside a string (models write literal newlines
in code arguments), which comes back escaped, so the arguments a client receives always parse.
``CallObject`` reads one ``{"name": ..., "arguments": ...}`` object (``parameters`` is Llama's
spelling) and says when a call can be announced: once its name is known and its arguments began.
"""

from __future__ import annotations

import json

from tokenizer_proc.tool_parsers.base import CallSyntaxError

WS = " \t\n\r"
ARG_KEYS = ("arguments", "parameters")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_ESCAPES = set('"\\/bfnrtu')
_HEX = set("0123456789abcdefABCDEF")
# number states that may end the number
_NUM_DONE = {"zero", "int", "frac", "exp_digits"}


class JsonSyntaxError(CallSyntaxError):
    pass


def _number_step(state: str, c: str) -> str | None:
    """The next state of the number grammar -?(0|[1-9]d*)(.d+)?([eE][+-]?d+)?, or None."""
    digit = c.isdigit() and c.isascii()
    if state == "sign":
        return "zero" if c == "0" else ("int" if digit else None)
    if state in ("zero", "int"):
        if digit and state == "int":
            return "int"
        return {".": "dot", "e": "exp", "E": "exp"}.get(c)
    if state in ("dot", "frac"):
        if digit:
            return "frac"
        return None if state == "dot" else {"e": "exp", "E": "exp"}.get(c)
    if state in ("exp", "exp_sign"):
        if digit:
            return "exp_digits"
        return "exp_sign" if state == "exp" and c in "+-" else None
    return "exp_digits" if state == "exp_digits" and digit else None


class JsonValue:
    """One JSON value; ``push`` each character after the value's first non-blank one."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # open containers: "{" or "["
        self.mode = "value"
        self.sub = ""  # number state, literal remainder, or unicode digits left
        self.empty_ok = False  # "]" / "}" may close a container that just opened
        self.done = False

    def push(self, c: str) -> str | None:
        """The text ``c`` adds to the value; None when the value already ended (``c`` is not
        part of it: only a number learns its end that way). Raises JsonSyntaxError."""
        if self.done:
            return None
        handler = getattr(self, "_" + self.mode)
        return handler(c)

    @property
    def complete(self) -> bool:
        """The value is whole if the text ended here (a top-level number needs no terminator)."""
        return self.done or (self.mode == "number" and not self.stack and self.sub in _NUM_DONE)

    # ------------------------------------------------------------------ states
    def _value(self, c: str) -> str:
        if c in WS and (self.stack or self.empty_ok):
            return c
        if self.empty_ok and c == "]" and self.stack[-1] == "[":
            return self._close(c)
        self.empty_ok = False
        if c == '"':
            self.mode = "string"
        elif c in "{[":
            self.stack.append(c)
            self.mode, self.empty_ok = ("key" if c == "{" else "value"), True
        elif c == "-" or (c.isdigit() and c.isascii()):
            self.mode, self.sub = "number", ("sign" if c == "-" else ("zero" if c == "0" else "int"))
        elif c in _LITERALS:
            self.mode, self.sub = "literal", _LITERALS[c][1:]
        else:
            raise JsonSyntaxError(f"unexpected {c!r} where a value starts")
        return c

    def _string(self, c: str) -> str:
        if c == '"':
            self._value_done(key=self.mode == "key_string")
            return c
        if c == "\\":
            self.mode = "escape" if self.mode == "string" else "key_escape"
            return c
        if c < " ":
            return json.dumps(c)[1:-1]  # a raw control character, escaped
        return c

    _key_string = _string

    def _escape(self, c: str) -> str:
        if c not in _ESCAPES:
            raise JsonSyntaxError(f"invalid escape \\{c}")
        key = self.mode == "key_escape"
        if c == "u":
            self.mode, self.sub = ("key_unicode" if key else "unicode"), "4"
        else:
            self.mode = "key_string" if key else "string"
        return c

    _key_escape = _escape

    def _unicode(self, c: str) -> str:
        if c not in _HEX:
            raise JsonSyntaxError(f"invalid \\u escape digit {c!r}")
        left = int(self.sub) - 1
        self.sub = str(left)
        if left == 0:
            self.mode = "key_string" if self.mode == "key_unicode" else "string"
        return c

    _key_unicode = _unicode

    def _number(self, c: str) -> str | None:
        nxt = _number_step(self.sub, c)
        if nxt is not None:
            self.sub = nxt
            return c
        if self.sub not in _NUM_DONE:
            raise JsonSyntaxError(f"unexpected {c!r} in a number")
        self._value_done()
        return None if self.done else self.push(c)

    def _literal(self, c: str) -> str:
        if not self.sub or c != self.sub[0]:
            raise JsonSyntaxError(f"unexpected {c!r} in a literal")
        self.sub = self.sub[1:]
        if not self.sub:
            self._value_done()
        return c

    def _key(self, c: str) -> str:
        if c in WS:
            return c
        if c == "}" and self.empty_ok:
            return self._close(c)
        if c != '"':
            raise JsonSyntaxError(f"expected a key, got {c!r}")
        self.empty_ok = False
        self.mode = "key_string"
        return c

    def _colon(self, c: str) -> str:
        if c in WS:
            return c
        if c != ":":
            raise JsonSyntaxError(f"expected ':', got {c!r}")
        self.mode = "value"
        return c

    def _after(self, c: str) -> str:
        if c in WS:
            return c
        if c == ",":
            self.mode = "key" if self.stack[-1] == "{" else "value"
            return c
        if c in "}]":
            return self._close(c)
        raise JsonSyntaxError(f"expected ',' or a closing bracket, got {c!r}")

    # ------------------------------------------------------------------ structure
    def _close(self, c: str) -> str:
        if self.stack[-1] != ("{" if c == "}" else "["):
            raise JsonSyntaxError(f"mismatched {c!r}")
        self.stack.pop()
        self.empty_ok = False
        self._value_done()
        return c

    def _value_done(self, key: bool = False) -> None:
        if key:
            self.mode = "colon"
        elif self.stack:
            self.mode = "after"
        else:
            self.mode, self.done = "done", True


class CallObject:
    """One ``{"name": "f", "arguments": {...}}`` object. Other keys are read and ignored.

    ``push`` returns True when the object closed. ``name`` is set once its string closed;
    ``args`` collects the arguments' text (``args_begun`` from its first character).
    ``require_args``: an object without arguments is not a call (Llama, where a bare JSON
    answer must not turn into one); otherwise it is a call with ``{}``.
    """

    def __init__(self, require_args: bool = False):
        self.require_args = require_args
        self.state = "open"
        self.key: str | None = None
        self.raw: list[str] = []  # the current key or name string, as pushed
        self.value: JsonValue | None = None
        self.name: str | None = None
        self.args: list[str] = []
        self.args_begun = False
        self.seen: set[str] = set()
        self.closed = False

    @property
    def announceable(self) -> bool:
        return self.name is not None and self.args_begun

    def push(self, c: str) -> bool:
        if self.state in ("open", "first", "colon", "after", "next") and c in WS:
            return False
        return getattr(self, "_" + self.state)(c)

    def _open(self, c: str) -> bool:
        if c != "{":
            raise JsonSyntaxError("a tool call is a JSON object")
        self.state = "first"
        return False

    def _first(self, c: str) -> bool:
        if c == "}":
            return self._close()
        return self._next(c)

    def _next(self, c: str) -> bool:
        if c != '"':
            raise JsonSyntaxError(f"expected a key, got {c!r}")
        self.value, self.raw, self.state = JsonValue(), [], "key"
        return self._key(c)

    def _key(self, c: str) -> bool:
        self.raw.append(self.value.push(c))
        if self.value.done:
            self.key = json.loads("".join(self.raw))
            if self.key in self.seen and (self.key == "name" or self.key in ARG_KEYS):
                raise JsonSyntaxError(f"{self.key!r} given twice")
            self.seen.add(self.key)
            self.state = "colon"
        return False

    def _colon(self, c: str) -> bool:
        if c != ":":
            raise JsonSyntaxError(f"expected ':', got {c!r}")
        self.state, self.value = "begin", JsonValue()
        return False

    def _begin(self, c: str) -> bool:
        if c in WS:
            return False
        if self.key == "name" and c != '"':
            raise JsonSyntaxError("a tool call's name is a string")
        if self.key in ARG_KEYS:
            if self.args_begun:
                raise JsonSyntaxError("arguments given twice")
            self.args_begun = True
        self.raw, self.state = [], "value"
        return self._value(c)

    def _value(self, c: str) -> bool:
        text = self.value.push(c)
        if text is None:  # a number ended on this character
            self._value_done()
            return self.push(c)
        if self.key == "name":
            self.raw.append(text)
        elif self.key in ARG_KEYS:
            self.args.append(text)
        if self.value.done:
            self._value_done()
        return False

    def _value_done(self) -> None:
        if self.key == "name":
            self.name = json.loads("".join(self.raw))
            if not self.name or not self.name.isprintable():
                raise JsonSyntaxError("a tool call's name is empty or not printable")
        self.state = "after"

    def _after(self, c: str) -> bool:
        if c == ",":
            self.state = "next"
            return False
        if c == "}":
            return self._close()
        raise JsonSyntaxError(f"expected ',' or '}}', got {c!r}")

    def _close(self) -> bool:
        if self.name is None:
            raise JsonSyntaxError("a tool call without a name")
        if not self.args_begun:
            if self.require_args:
                raise JsonSyntaxError("a tool call without arguments")
            self.args, self.args_begun = ["{}"], True
        self.closed, self.state = True, "done"
        return True

    def _done(self, c: str) -> bool:
        raise JsonSyntaxError("text after the call object")
