"""Incremental detokenization with the prefix/read offset technique.

Decoding one token at a time is wrong for two reasons: a token may hold only part of a UTF-8
character (byte-level BPE splits emoji and CJK), and SentencePiece-style decoders change a
token's text depending on what precedes it (the leading-space rule). So we always decode a
small window: ``ids[prefix:read]`` is text already emitted, ``ids[prefix:]`` is that text plus
the new tokens, and the difference is the delta. Both decodes start at the same token, so any
context effect is identical on both sides and cancels.

A delta that ends in U+FFFD is held back (offsets stay put) until a later token completes the
character; ``flush()`` at the end of the request releases whatever is still held, so the
concatenation of all deltas equals the text of the whole sequence.

The last few prompt tokens serve as left context, unless the prompt ends inside a character
(possible with token-id prompts): then the completion is decoded on its own.

``MAX_PENDING`` bounds the work when a model emits bytes that never form a valid character: after
that many held tokens we emit the replacement characters anyway (the only case where the deltas
could differ from a one-shot decode).
"""

from __future__ import annotations

from typing import Protocol, Sequence

REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context so the first generated token decodes with its real spacing.
PROMPT_CONTEXT = 5
MAX_PENDING = 32


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, decoder: Decoder, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.decoder = decoder
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = [int(t) for t in prompt_ids[-PROMPT_CONTEXT:]]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._prefix_text = self._decode(self.prefix_offset, self.read_offset)
        if self._prefix_text.endswith(REPLACEMENT):
            # The prompt (token ids from a client) ends inside a character: gluing generated
            # bytes onto it would change what they decode to. Decode the completion on its own.
            self.ids, self.read_offset, self._prefix_text = [], 0, ""

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.decoder.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _advance(self, full_text: str) -> str:
        """Emit everything past the already-emitted prefix and move the window forward."""
        delta = full_text[len(self._prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self._prefix_text = self._decode(self.prefix_offset, self.read_offset)
        return delta

    def add(self, token_id: int) -> str:
        """Append one token; return the newly stable text (possibly empty)."""
        self.ids.append(int(token_id))
        full_text = self._decode(self.prefix_offset)
        if len(full_text) <= len(self._prefix_text):
            return ""  # e.g. a skipped special token: nothing visible yet
        pending = len(self.ids) - self.read_offset
        if full_text.endswith(REPLACEMENT) and pending < MAX_PENDING:
            return ""  # an incomplete character: wait for the bytes that finish it
        return self._advance(full_text)

    def flush(self) -> str:
        """At the end of the request: release held-back text, broken characters included."""
        if self.read_offset == len(self.ids):
            return ""
        full_text = self._decode(self.prefix_offset)
        if len(full_text) <= len(self._prefix_text):
            return ""
        return self._advance(full_text)

    @property
    def has_pending(self) -> bool:
        return self.read_offset < len(self.ids)
