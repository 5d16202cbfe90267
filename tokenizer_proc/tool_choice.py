"""Which tool-call parser, if any, reads a chat request's answer: vLLM's rules for ``tools`` and
``tool_choice``.

- ``tool_choice`` unset means ``"auto"`` when ``tools`` are given, else ``"none"``;
- ``"none"``: plain text (the tools still reach the chat template, as in vLLM);
- any other choice without ``tools``: 400 "When using `tool_choice`, `tools` must be set.";
- ``"required"`` or a named function: 400 here, since forcing a call needs constrained
  decoding, which this server does not have;
- ``"auto"``: the server's parser, which exists only with ``--enable-auto-tool-choice`` and
  ``--tool-call-parser``; without them vLLM's 400. An empty ``tools`` list gets text.
"""

from __future__ import annotations

from typing import Any

from tokenizer_proc.errors import bad_request

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


def resolve_tool_choice(choice: Any, tools: list | None, server_parser: str | None) -> str | None:
    """The parser's name for this request, None for a plain-text answer; APIError(400) else."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if tools is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice == "required" or isinstance(choice, dict):
        raise bad_request("tool_choice 'required' and named function choices are not supported by this server "
                          "(no constrained decoding of tool calls); use 'auto' or 'none'", "tool_choice")
    if choice != "auto":
        raise bad_request(f"Invalid value for 'tool_choice': {choice!r}. Supported values are 'none' and 'auto'.",
                          "tool_choice")
    if server_parser is None:
        raise bad_request(AUTO_NEEDS_FLAGS, "tool_choice")
    return server_parser if tools else None
