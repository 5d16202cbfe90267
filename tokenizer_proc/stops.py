"""Stop-string matching on the detokenized text of one request.

Rule: the request stops at the first point in the text where *any* stop string is complete, i.e.
the match with the smallest end position wins (ties: the longer string, which starts earlier).
This is the only rule that gives the same answer however the text was chunked — one token per
step, several tokens per step (speculative decoding), or the whole text at once — because it is
a property of the text alone. "First listed wins" (an old vLLM bug) and "earliest start wins"
both depend on chunking.

The text is trimmed at the start of the match (or kept through its end with
``include_stop_str_in_output``). While streaming, a tail that could still become the start of a
stop string is held back, so stop text never leaks to the client before we know.

The caller feeds text one token's worth at a time; the token whose text completed the match is
the last one counted in usage (``completion_tokens`` includes it — the tokens were generated and
billed, and it matches how the engine counts an EOS that ends a request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class StopMatch:
    stop: str  # the stop string that matched
    emit: str  # text to emit with this feed (already trimmed)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``: the text a
    streaming reader must hold back because it may still become ``tag`` (tool-call and reasoning
    tags; ``StopMatcher`` does the same over several stop strings)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def find_earliest_stop(text: str, stops: Sequence[str], search_from: int = 0) -> tuple[int, int, str] | None:
    """The match (start, end, stop) with the smallest end in ``text``; only matches ending after
    ``search_from`` are considered (earlier text was already checked)."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        # A match ending after search_from starts at or after search_from - len(stop) + 1.
        start = text.find(stop, max(0, search_from - len(stop) + 1))
        if start < 0:
            continue
        end = start + len(stop)
        if best is None or end < best[1] or (end == best[1] and start < best[0]):
            best = (start, end, stop)
    return best


class StopMatcher:
    """Streams text through, holding back any tail that may still turn into a stop string."""

    def __init__(self, stops: Sequence[str], include_stop_in_output: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.include = include_stop_in_output
        self.max_len = max((len(s) for s in self.stops), default=0)
        self.tail = ""  # text received but not yet emitted
        self.matched: str | None = None

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        for k in range(min(len(text), self.max_len - 1), 0, -1):
            suffix = text[-k:]
            if any(s.startswith(suffix) for s in self.stops):
                return k
        return 0

    def feed(self, text: str, allow_match: bool = True) -> StopMatch | str:
        """Add text; return the emittable text, or a StopMatch once a stop string completes.

        ``allow_match=False`` (before ``min_tokens``) still holds back a possible stop prefix but
        never finishes the request.
        """
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buf = self.tail + text
        if allow_match and text:
            found = find_earliest_stop(buf, self.stops, search_from=len(self.tail))
            if found is not None:
                start, end, stop = found
                self.matched = stop
                self.tail = ""
                return StopMatch(stop=stop, emit=buf[: end if self.include else start])
        keep = self._holdback(buf)
        self.tail = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The request ended for another reason: the held tail was never a stop, emit it."""
        out, self.tail = self.tail, ""
        return out
