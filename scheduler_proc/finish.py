"""Token-level finish rules applied to a multi-token chunk (docs/design.md §5).

Scan every accepted token in order; the earliest finishing position wins. At one position a
stop token (EOS / stop_token_ids, honoured only once ``min_new_tokens`` is reached) beats the
length cap. Only tokens up to the cut are emitted; usage counts exactly those.
Stop *strings* are matched in the tokenizer process, which then aborts the request here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cut:
    keep: int  # how many of the new tokens to emit
    reason: str | None  # None: not finished; "stop" | "length"
    matched: int | None = None  # the stop token id, when reason == "stop"


_GO_ON = tuple(Cut(n, None) for n in range(17))  # the usual verdict, for chunks of up to 16 tokens


def apply_finish_rules(
    new_tokens: list[int],
    num_emitted: int,
    stop_ids: frozenset[int],
    min_new_tokens: int,
    max_new_tokens: int,
) -> Cut:
    """``num_emitted``: tokens already emitted before this chunk. ``max_new_tokens`` already
    includes the context-length cap."""
    if num_emitted + len(new_tokens) < max_new_tokens and stop_ids.isdisjoint(new_tokens):
        return _GO_ON[len(new_tokens)] if len(new_tokens) < len(_GO_ON) else Cut(len(new_tokens), None)
    for i, tok in enumerate(new_tokens):
        produced = num_emitted + i + 1
        if tok in stop_ids and produced > min_new_tokens:
            return Cut(i + 1, "stop", tok)
        if produced >= max_new_tokens:
            return Cut(i + 1, "length")
    return Cut(len(new_tokens), None)
