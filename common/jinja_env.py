"""The Jinja environment chat templates render in, and where a ``--chat-template`` comes from.

Shared by the CLI (which refuses a template that does not compile before any process starts) and
the HTTP front (which renders with it). jinja2 is imported only by the modules that use this.

The environment mirrors HF ``apply_chat_template``'s: an immutable sandbox, ``trim_blocks`` /
``lstrip_blocks``, loop controls, a non-HTML-escaping ``tojson``, ``raise_exception``,
``strftime_now`` and a no-op ``{% generation %}`` block.

``--chat-template VALUE`` (vLLM's rule): a file that opens is read; otherwise a value with any of
``{``, ``}`` or a newline is the template itself; anything else looks like a path that does not
exist, which is an error rather than a one-line template.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

JINJA_CHARS = ("{", "}", "\n")


class TemplateSourceError(ValueError):
    """A --chat-template value that names no readable file and is no template either."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant spans for training masks in HF;
    for serving it only renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """A namespace that refuses dunder/underscore names (HF's sandbox hardening)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same trick as jinja's Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson HTML-escapes; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = lambda *a, **k: dict(*a, **k)
    return env


def read_template_source(value: str) -> str:
    """The template text for a --chat-template value (see the module docstring)."""
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in an inline template
        if any(c in value for c in JINJA_CHARS):
            return value
        raise TemplateSourceError(f"{value!r} looks like a file path but cannot be read ({exc.__class__.__name__}: "
                                  f"{getattr(exc, 'strerror', None) or exc})") from None


def compile_template(source: str) -> jinja2.Template:
    """Raises ValueError with jinja's message (and line) when the template does not compile."""
    try:
        return make_environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"does not compile: {exc.message} (line {exc.lineno})") from None
    except RecursionError:  # jinja's parser and compiler recurse once per nesting level
        raise ValueError("does not compile: nested too deeply") from None
