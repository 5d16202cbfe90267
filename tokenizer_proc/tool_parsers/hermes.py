"""Hermes-style calls (Qwen2.5, Qwen3, Hermes 2/3): each call is a JSON object between tags,

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several in a row allowed, text around them is content. The tags are added tokens that are not
special in Qwen's tokenizers, but they are in some Hermes ones, so special tokens are kept
(vLLM's hermes parser does the same). A call without ``arguments`` gets ``{}``.
"""

from __future__ import annotations

from tokenizer_proc.tool_parsers.json_scan import CallObject
from tokenizer_proc.tool_parsers.tagged import CallBody, TaggedCallParser


class HermesParser(TaggedCallParser):
    name = "hermes"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def _new_body(self) -> CallBody:
        return CallObject(require_args=False)
