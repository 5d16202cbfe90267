"""The answers of forced tool calls (``tool_choice`` "required" or a named function,
tool_choice.py), whose shape a grammar imposed on the whole answer, so no --tool-call-parser is
needed:

- ``RequiredCallsParser``: a JSON array of ``{"name": ..., "parameters": {...}}`` objects (vLLM's
  shape), each one a call; whitespace around them is dropped;
- ``NamedCallParser``: the whole answer is the arguments of one call to the named function.

Both are character-level machines like the other parsers (base.py), so a stream folds into the
non-streaming answer however the text was cut. They are not --tool-call-parser names (common.parsers).
"""

from __future__ import annotations

from tokenizer_proc.tool_parsers.base import ToolParser
from tokenizer_proc.tool_parsers.llama3_json import Llama3JsonParser


class RequiredCallsParser(Llama3JsonParser):
    """Llama 3's call reader, with the array's brackets and commas between the calls instead of
    its ``;``. Text that does not open an array with a call is content (only a model the grammar
    did not constrain writes it); text after the closing bracket is content too."""

    name = "required"

    def _start(self, c: str) -> bool:
        """Before the first call: whitespace, ``[``, whitespace, then ``{`` opens the call."""
        rest = (self.held + c).lstrip()
        if not rest or (rest[0] == "[" and not rest[1:].strip()):
            self.held += c
            return True
        if rest[0] == "[" and rest[1:].strip() == "{":
            return self._open(c)
        return self._pass(self.held)

    def _between(self, c: str) -> bool:
        """After a call: whitespace and one ``,`` then the next call, or ``]`` ending the array."""
        if c.isspace() or (c == "," and "," not in self.held):
            self.held += c
            return True
        if c == "{" and "," in self.held:
            return self._open(c)
        if c == "]" and "," not in self.held:
            self.held, self.state = "", "closed"
            return True
        return self._pass(self.held)

    def _closed(self, c: str) -> bool:
        """After the array: whitespace is dropped, anything else is content from there on."""
        if c.isspace():
            return True
        return self._pass("")


class NamedCallParser(ToolParser):
    """One call to ``function``, announced with the first text; every character is arguments."""

    name = "named"
    keeps_special_tokens = False
    calls_finish = False  # OpenAI and vLLM keep finish_reason "stop" for a named tool_choice

    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function

    def _consume(self, text: str) -> None:
        if not self.started:
            self._start_call(self.function)
        self._out.add_arguments(0, text)

    def _end(self) -> None:
        if not self.started:  # an empty answer is still the call (with empty arguments)
            self._start_call(self.function)
        self.completed = 1
