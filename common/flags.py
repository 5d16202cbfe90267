"""Command-line flags declared once, as metadata on a frozen dataclass's fields.

A field that is a flag carries a ``Flag`` (built by ``opt``): its spellings, help, group and how
to parse a value. ``add_flags`` turns a dataclass into argparse options, and ``given_values`` turns
the parsed namespace back into the dataclass; a field whose type is itself a dataclass
contributes its own flags (the router's retry / breaker / cache settings). The help of every
flag ends with its default, so ``--help`` is the reference and nothing else lists the flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable


class ArgError(ValueError):
    """A flag value that cannot work; the message starts with the flag's name."""


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # the first is the one error messages and the docs use
    help: str
    group: str
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # default: the field's type (int, float, str)
    choices: tuple[str, ...] | None = None  # listed in --help; checked by the dataclass's validation
    nargs: str | None = None
    default_text: str | None = None  # what --help calls the default when the value says little (None)
    off: tuple[str, ...] = ()  # a switch: spellings that turn it back off (last one given wins)
    invert: bool = False  # a switch that stores False (--skip-warmup for warmup)
    positive: bool = False  # a number that must be > 0 when given


def opt(default: Any, *names: str, help: str, group: str, secret: bool = False, **kw: Any) -> Any:
    """A dataclass field that is also a flag (see ``Flag``); ``secret`` keeps it out of repr."""
    return field(default=default, repr=not secret, metadata={"flag": Flag(names=names, help=help, group=group, **kw)})


class Parser(argparse.ArgumentParser):
    """argparse that raises ArgError instead of printing usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise ArgError(message)


def formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog, max_help_position=34, width=100)


def flag_fields(cls: type) -> list[tuple[tuple[str, ...], dataclasses.Field, Flag, type]]:
    """(path, field, flag, value type) of every flag of ``cls``, nested dataclasses walked in order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind = _unwrap(hints[f.name])
        if dataclasses.is_dataclass(kind):
            out += [((f.name, *path), g, fl, t) for path, g, fl, t in flag_fields(kind)]
        elif "flag" in f.metadata:
            out.append(((f.name,), f, f.metadata["flag"], kind))
    return out


def _unwrap(hint: Any) -> Any:
    """``X | None`` -> X."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def _shown_default(f: dataclasses.Field, fl: Flag, kind: Any) -> str:
    if fl.default_text is not None:
        return fl.default_text
    value = _default(f)
    if kind is bool:
        return "on" if value != fl.invert else "off"
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return " ".join(map(str, value)) or "none"
    return str(value)


def add_flags(parser: argparse.ArgumentParser, cls: type, groups: dict[str, str] | None = None) -> None:
    """One argparse option per flag field of ``cls``, in declaration order, in its group.
    ``groups``: a description per group title."""
    made: dict[str, argparse._ArgumentGroup] = {}
    for path, f, fl, kind in flag_fields(cls):
        if fl.group not in made:
            made[fl.group] = parser.add_argument_group(fl.group, (groups or {}).get(fl.group))
        group = made[fl.group]
        dest = "__".join(path)
        shown = _shown_default(f, fl, kind)
        if kind is bool:
            group.add_argument(*fl.names, dest=dest, action="store_const", const=not fl.invert,
                               default=argparse.SUPPRESS, help=_escape(f"{fl.help} (default: {shown})"))
            if fl.off:
                group.add_argument(*fl.off, dest=dest, action="store_const", const=fl.invert,
                                   default=argparse.SUPPRESS, help=f"undoes {fl.names[0]}")
            continue
        parse = fl.parse or _element_type(kind)
        choices = f" {{{', '.join(map(str, fl.choices))}}}" if fl.choices else ""
        group.add_argument(*fl.names, dest=dest, type=parse, nargs=fl.nargs, default=argparse.SUPPRESS,
                           metavar=fl.metavar, help=_escape(f"{fl.help}{';' if choices else ''}{choices} (default: {shown})"))


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse %-formats help


def _element_type(kind: Any) -> Callable[[str], Any]:
    if typing.get_origin(kind) is tuple:
        return typing.get_args(kind)[0]
    return kind if kind in (int, float) else str


def given_values(cls: type, ns: argparse.Namespace, prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of ``cls`` whose flags were given (lists as tuples), nested dataclasses built
    whole (their fields not given keep their defaults)."""
    hints = typing.get_type_hints(cls)
    given = vars(ns)
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        kind = _unwrap(hints[f.name])
        if dataclasses.is_dataclass(kind):
            kw[f.name] = kind(**given_values(kind, ns, path))
        elif "__".join(path) in given:
            value = given["__".join(path)]
            kw[f.name] = tuple(value) if isinstance(value, list) else value
    return kw


def check_numbers(obj: Any) -> None:
    """``positive`` numbers above 0 and ``choices`` kept, for every flag of ``obj``; raises ArgError."""
    for path, _f, fl, _kind in flag_fields(type(obj)):
        value = obj
        for name in path:
            value = getattr(value, name)
        if value is None:
            continue
        if fl.positive and value <= 0:
            raise ArgError(f"{fl.names[0]}: must be a positive number, got {value}")
        if fl.choices and value not in fl.choices:
            raise ArgError(f"{fl.names[0]}: expected one of {', '.join(map(str, fl.choices))}, got {value!r}")


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def token_count(value: str) -> int:
    """An integer, or vLLM's human-readable form for token counts: 32k = 32000, 32K = 32768,
    25.6k = 25600 (decimals only with the decimal suffixes k/m/g/t)."""
    text = value.strip()
    try:
        return int(text)
    except ValueError:
        pass
    number, suffix = text[:-1], text[-1:]
    if suffix in _DECIMAL and number.replace(".", "", 1).isdigit():
        return int(float(number) * _DECIMAL[suffix])
    if suffix in _BINARY and number.isdigit():
        return int(number) * _BINARY[suffix]
    raise argparse.ArgumentTypeError(f"invalid token count {value!r} (an integer, or e.g. 32k = 32000, 32K = 32768)")
