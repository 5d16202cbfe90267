"""Tool-call parsers by name (``tandem serve --tool-call-parser NAME``).

The names are also listed in ``common.args.TOOL_CALL_PARSERS``, which the CLI checks without
importing this process's package; a unit test keeps the two lists equal.
"""

from __future__ import annotations

from tokenizer_proc.tool_parsers.base import (
    CallDelta,
    ParsedMessage,
    ParserOutput,
    ToolCall,
    ToolParser,
    accumulate,
    parse_complete,
)
from tokenizer_proc.tool_parsers.gemma4 import Gemma4Parser
from tokenizer_proc.tool_parsers.hermes import HermesParser
from tokenizer_proc.tool_parsers.llama3_json import Llama3JsonParser

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, Gemma4Parser)}


def parser_class(name: str) -> type[ToolParser]:
    return PARSERS[name]


__all__ = ["PARSERS", "CallDelta", "ParsedMessage", "ParserOutput", "ToolCall", "ToolParser", "accumulate",
           "parse_complete", "parser_class"]
