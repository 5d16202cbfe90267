"""Helpers for the tool-call parser tests: feed a parser pieces of a text the way the
detokenizer would, and compare answers without their random call ids."""

from __future__ import annotations

import itertools
from typing import Callable, Union

from tokenizer_proc.tool_parsers import (
    ParsedMessage,
    ParserOutput,
    ToolParser,
    accumulate,
    parse_complete,
    parser_class,
)

# a --tool-call-parser name, or a factory (the forced tool_choice parsers take arguments)
ParserSpec = Union[str, Callable[[], ToolParser]]


def make(name: ParserSpec) -> ToolParser:
    return parser_class(name)() if isinstance(name, str) else name()


def whole(name: ParserSpec, text: str) -> ParsedMessage:
    return parse_complete(make(name), text)


def stream(name: ParserSpec, pieces: list[str]) -> tuple[ParsedMessage, list[ParserOutput], bool]:
    """(the accumulated stream, the outputs in order, whether a call broke mid-stream)."""
    parser = make(name)
    outputs = [parser.feed(p) for p in pieces] + [parser.finish()]
    return accumulate(outputs), outputs, parser.broken is not None


def shape(m: ParsedMessage) -> tuple:
    return m.content, [(c.name, c.arguments) for c in m.tool_calls]


def cut(text: str, points: tuple[int, ...]) -> list[str]:
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def sized(text: str, sizes: list[int]) -> list[str]:
    out, i, k = [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        out.append(text[i:i + n])
        i, k = i + n, k + 1
    return out


def assert_split_invariant(name: ParserSpec, text: str, three_way: bool = False) -> ParsedMessage:
    """Every split of ``text`` into two pieces (and three, if asked) and one character at a time
    streams to the non-streaming answer; returns that answer."""
    want = shape(whole(name, text))
    pieces_list = [cut(text, (i,)) for i in range(len(text) + 1)] + [list(text)]
    if three_way:
        pieces_list += [cut(text, (i, j)) for i in range(len(text) + 1) for j in range(i, len(text) + 1)]
    for pieces in pieces_list:
        got, outputs, broken = stream(name, pieces)
        assert not broken, pieces
        assert shape(got) == want, pieces
        check_deltas(outputs)
    return whole(name, text)


def check_deltas(outputs: list[ParserOutput]) -> None:
    """A call's first delta names it (with an id); every later delta only extends arguments."""
    named: set[int] = set()
    for out in outputs:
        for d in out.calls:
            if d.name is None:
                assert d.index in named and d.id is None
            else:
                assert d.index not in named and d.id.startswith("chatcmpl-tool-")
                assert d.index == len(named)  # indices count up from 0
                named.add(d.index)
