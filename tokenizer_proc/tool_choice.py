"""What a chat request's ``tools`` and ``tool_choice`` ask for: which parser, if any, reads the
answer, and the grammar that forces a call. vLLM's rules:

- ``tool_choice`` unset means ``"auto"`` when ``tools`` are given, else ``"none"``;
- ``"none"``: plain text (the tools still reach the chat template, as in vLLM);
- any other choice without ``tools``: 400 "When using `tool_choice`, `tools` must be set.";
- ``"auto"``: the server's parser, which exists only with ``--enable-auto-tool-choice`` and
  ``--tool-call-parser``; without them vLLM's 400. An empty ``tools`` list gets text;
- ``"required"``: the answer is constrained to a JSON array of calls, ``[{"name": ...,
  "parameters": {...}}, ...]`` (at least one; exactly one with ``parallel_tool_calls: false``),
  each item one of the tools (``anyOf``), read by ``RequiredCallsParser``;
- ``{"type": "function", "function": {"name": F}}``: the answer is constrained to F's
  ``parameters`` schema and is the arguments of one call to F (``NamedCallParser``); F must be
  one of ``tools``.
Neither forced form needs the server flags. A tool without ``parameters`` takes any object.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from proto.messages import GrammarSpec
from tokenizer_proc.errors import bad_request
from tokenizer_proc.structured import json_grammar
from tokenizer_proc.tool_parsers import ToolParser, parser_class
from tokenizer_proc.tool_parsers.forced import NamedCallParser, RequiredCallsParser

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
ANY_OBJECT = {"type": "object", "properties": {}}
DEFS_KEYS = ("$defs", "definitions")  # where JSON Schema keeps the definitions "#/$defs/X" points at


@dataclass(frozen=True)
class ToolChoice:
    """``parser`` makes a fresh parser for one choice (None: the answer is plain text);
    ``grammar`` is set for the forced choices."""

    parser: Callable[[], ToolParser] | None = None
    grammar: GrammarSpec | None = None
    keeps_special_tokens: bool = False


def resolve_tool_choice(choice: Any, tools: list | None, server_parser: str | None,
                        parallel_tool_calls: bool = True) -> ToolChoice:
    """``tools`` were checked by ``chat_messages.validate_tools``; APIError(400) on a bad choice."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolChoice()
    if tools is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice == "required":
        if not tools:
            raise bad_request('tool_choice "required" needs at least one tool in `tools`.', "tool_choice")
        schema = required_schema(tools, parallel_tool_calls)
        return ToolChoice(RequiredCallsParser, json_grammar(schema, "tools"))
    if isinstance(choice, dict):
        name = named_function(choice)
        function = next((t["function"] for t in tools if t["function"]["name"] == name), None)
        if function is None:
            raise bad_request(f"Tool '{name}' has not been passed in `tools`.", "tool_choice.function.name")
        return ToolChoice(functools.partial(NamedCallParser, name),
                          json_grammar(function.get("parameters") or ANY_OBJECT, "tools"))
    if choice != "auto":
        raise bad_request(f"Invalid value for 'tool_choice': {choice!r}. Supported values are 'none', 'auto', "
                          "'required' and a named function.", "tool_choice")
    if server_parser is None:
        raise bad_request(AUTO_NEEDS_FLAGS, "tool_choice")
    if not tools:
        return ToolChoice()
    cls = parser_class(server_parser)
    return ToolChoice(cls, keeps_special_tokens=cls.keeps_special_tokens)


def named_function(choice: dict) -> str:
    """The name in OpenAI's ``{"type": "function", "function": {"name": ...}}``."""
    if choice.get("type", "function") != "function":
        raise bad_request(f"Invalid value for 'tool_choice.type': expected 'function', got {choice.get('type')!r}.",
                          "tool_choice.type")
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise bad_request("A named tool_choice needs 'function.name', a string: "
                          '{"type": "function", "function": {"name": ...}}.', "tool_choice.function.name")
    return name


def required_schema(tools: list[dict], parallel_tool_calls: bool = True) -> dict:
    """vLLM's schema for ``"required"``: an array of ``{"name", "parameters"}`` objects, any of
    the tools. Each tool's own definitions (``$defs``) move to the root, where its ``$ref``s
    (``#/$defs/X``) point once its schema sits inside the array; a name two tools define
    differently is a 400."""
    items, defs = [], {}
    for i, tool in enumerate(tools):
        function = tool["function"]
        params = dict(function.get("parameters") or ANY_OBJECT)
        for key in DEFS_KEYS:
            where = f"tools[{i}].function.parameters.{key}"
            own = params.pop(key, None) or {}
            if not isinstance(own, dict):
                raise bad_request(f"Invalid type for '{where}': expected an object.", where)
            for name, schema in own.items():
                if defs.setdefault(key, {}).setdefault(name, schema) != schema:
                    raise bad_request(f"Tool definition '{name}' has multiple schemas, which is not supported.", where)
        items.append({"properties": {"name": {"type": "string", "enum": [function["name"]]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


