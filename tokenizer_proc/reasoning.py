"""Reasoning parsers (``tandem serve --reasoning-parser NAME``): a chat answer's ``<think>``
block becomes ``reasoning_content``, the rest ``content``. Completions are never parsed (vLLM
parses chat only).

Both parsers read the same notation: reasoning runs until ``</think>``; everything after it is
content, tags included (the tool-call parser then reads the content only, as in vLLM). Where
the answer starts is set by the prompt and the parser's default:

- the prompt's last think tag is ``<think>``: reasoning is open (DeepSeek-R1, Qwen3.5 and
  Qwen3-Thinking templates end the prompt with it, so the model never writes it);
- the prompt ends with ``</think>`` (and whitespace): the template closed the block, typically
  Qwen3's ``enable_thinking: false`` writing an empty one, so the whole answer is content
  (vLLM's ``prompt_is_reasoning_end``). With ``continue_final_message`` a ``</think>`` anywhere
  after the last ``<think>`` counts: the continued answer already left its reasoning.
  Unlike vLLM, a ``</think>`` from an earlier turn followed by more prompt does not count, so a
  multi-turn history cannot silence the parser;
- otherwise ``deepseek_r1`` starts in reasoning (R1 writes no opening tag), and ``qwen3`` does
  unless ``chat_template_kwargs.enable_thinking`` is false (current vLLM: Qwen3.5 templates put
  ``<think>`` in the prompt, older ones let the model write it).

In reasoning, a ``<think>`` the model writes itself before any reasoning text is dropped (with
the whitespace before it). An answer that ends inside the block (length cap) is all reasoning,
with null content.

The parser is a character-level state machine, like the tool-call parsers: text that may still
be a tag is held back, so its output depends only on the text, never on how it was cut into
pieces, and the non-streaming split is the same machine fed the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from common.parsers import REASONING_PARSERS
from tokenizer_proc.stops import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


def starts_in_reasoning(name: str, prompt: str, template_kwargs: dict | None, continue_final: bool) -> bool:
    """Whether the answer to ``prompt`` (the rendered chat) begins inside the think block."""
    last_open, last_close = prompt.rfind(OPEN), prompt.rfind(CLOSE)
    if last_open > last_close:
        return True
    if last_close >= 0 and (continue_final or not prompt[last_close + len(CLOSE):].strip()):
        return False
    switch = REASONING_PARSERS[name]  # the kwarg that turns thinking off, if the parser has one
    return switch is None or bool((template_kwargs or {}).get(switch, True))


def grammar_after_reasoning(grammar, in_reasoning: bool, tok):
    """(grammar, in_reasoning) for a chat request under a reasoning parser. An answer that starts
    in reasoning keeps its grammar for after ``</think>``: the model reasons unconstrained, then
    the grammar binds from the token after the tag (vLLM's and SGLang's behaviour), which the
    worker can see only if the tag is one token (Qwen3's, DeepSeek-R1's). If it is not, the
    grammar binds from the first token and the answer is all content (no reasoning to split)."""
    if grammar is None or not in_reasoning:
        return grammar, in_reasoning
    end = tok.token_to_id(CLOSE)
    if end is None:
        return grammar, None
    return msgspec.structs.replace(grammar, after=end), in_reasoning


def tags_are_special(tok) -> bool:
    """Whether the tokenizer marks a think tag special, so that the request must decode with
    special tokens kept for the parser to see it (as the hermes tool parser does for its tags).
    Qwen3's and DeepSeek-R1's tags are plain added tokens."""
    return tok.is_special(OPEN) or tok.is_special(CLOSE)


@dataclass
class ReasoningOutput:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    def __init__(self, in_reasoning: bool):
        self.in_reasoning = in_reasoning
        self.had_reasoning = in_reasoning  # the answer had a think block (non-streaming: null vs "")
        self._opening = in_reasoning  # no reasoning text yet: a <think> of the model's own is dropped
        self._held = ""

    def feed(self, text: str) -> ReasoningOutput:
        out = ReasoningOutput()
        buf, self._held = self._held + text, ""
        while buf and self.in_reasoning:
            buf = self._step(buf, out)
        if not self.in_reasoning:
            out.content += buf
        return out

    def finish(self) -> ReasoningOutput:
        """The end of the answer: held text was no tag after all."""
        held, self._held = self._held, ""
        return ReasoningOutput(reasoning=held) if self.in_reasoning else ReasoningOutput(content=held)

    def _step(self, buf: str, out: ReasoningOutput) -> str:
        """Consume from ``buf`` (in reasoning); return what is left for the next step."""
        if self._opening:
            stripped = buf.lstrip()
            if stripped.startswith(OPEN):
                self._opening = False
                return stripped[len(OPEN):]
            if not stripped or OPEN.startswith(stripped):
                self._held = buf  # whitespace, or a part of <think>: wait for more
                return ""
            self._opening = False
        end = buf.find(CLOSE)
        if end >= 0:
            out.reasoning += buf[:end]
            self.in_reasoning = False
            return buf[end + len(CLOSE):]
        keep = partial_suffix(buf, CLOSE)
        out.reasoning += buf[:len(buf) - keep]
        self._held = buf[len(buf) - keep:]
        return ""


class ReasoningTokenCounter:
    """A choice's reasoning tokens, for ``usage.completion_tokens_details.reasoning_tokens`` (what
    vLLM reports under a reasoning parser): the tokens whose text lies in the think block, tags
    excluded, by the parser's rules (an opening tag the model writes first is dropped with the
    whitespace before it; the block ends at the first closing tag). A token counts if its text
    overlaps the block's text; one with no text yet (part of a character) if the block holds the
    character it starts. Counted from the whole answer, so steps cannot change the count."""

    def __init__(self, in_reasoning: bool):
        self.in_reasoning = in_reasoning
        self.pieces: list[str] = []  # each kept token's text, in order

    def feed(self, token_text: str) -> None:
        if self.in_reasoning:
            self.pieces.append(token_text)

    @property
    def count(self) -> int:
        text = "".join(self.pieces)
        stripped = text.lstrip()
        start = len(text) - len(stripped) + len(OPEN) if stripped.startswith(OPEN) else 0
        end = text.find(CLOSE, start)
        end = len(text) if end < 0 else end
        count = pos = 0
        for piece in self.pieces:
            a, pos = pos, pos + len(piece)
            count += (a < end and pos > start) if piece else start <= a < end
        return count


def split_reasoning(parser: ReasoningParser, text: str) -> tuple[str | None, str]:
    """The non-streaming answer: (reasoning, or None when there was no think block; content)."""
    outs = [parser.feed(text), parser.finish()]
    reasoning = "".join(o.reasoning for o in outs)
    return (reasoning if parser.had_reasoning else None), "".join(o.content for o in outs)
