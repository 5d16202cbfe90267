"""The parser registries, by the names ``--tool-call-parser`` and ``--reasoning-parser`` take.

The one table of each: the CLI checks names against it before any process starts, and the front
builds its parsers from it (``tokenizer_proc.tool_parsers.parser_class``,
``tokenizer_proc.reasoning.starts_in_reasoning``). A tool-call parser is named by where its class
lives (``module:Class``), imported only by the front, so this package imports no process package.
"""

from __future__ import annotations

TOOL_CALL_PARSERS: dict[str, str] = {
    "hermes": "tokenizer_proc.tool_parsers.hermes:HermesParser",
    "llama3_json": "tokenizer_proc.tool_parsers.llama3_json:Llama3JsonParser",
    "gemma4": "tokenizer_proc.tool_parsers.gemma4:Gemma4Parser",
}

# name -> the chat_template_kwargs switch that, when false, makes the answer start as content
# when the prompt does not say (None: the answer always starts in reasoning, as DeepSeek-R1
# writes no opening tag). SGLang spells deepseek-r1; the CLI takes both.
REASONING_PARSERS: dict[str, str | None] = {
    "deepseek_r1": None,
    "qwen3": "enable_thinking",
}
