"""Tool-call parsers by name (``tandem serve --tool-call-parser NAME``): the registry is
``common.parsers.TOOL_CALL_PARSERS`` (name -> ``module:Class``), which the CLI checks names
against without importing this process's package."""

from __future__ import annotations

import importlib

from common.parsers import TOOL_CALL_PARSERS
from tokenizer_proc.tool_parsers.base import (
    CallDelta,
    ParsedMessage,
    ParserOutput,
    ToolCall,
    ToolParser,
    accumulate,
    parse_complete,
)


def parser_class(name: str) -> type[ToolParser]:
    """The class registered as ``name`` (KeyError for a name that is not registered)."""
    module, _, cls = TOOL_CALL_PARSERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["CallDelta", "ParsedMessage", "ParserOutput", "ToolCall", "ToolParser", "accumulate",
           "parse_complete", "parser_class"]
