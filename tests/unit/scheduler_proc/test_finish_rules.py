"""Finish rules on multi-token chunks equal the one-token-at-a-time reference (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_proc.finish import apply_finish_rules


def one_at_a_time(tokens, stop_ids, min_new, max_new):
    out = []
    for tok in tokens:
        out.append(tok)
        if tok in stop_ids and len(out) > min_new:
            return out, "stop"
        if len(out) >= max_new:
            return out, "length"
    return out, None


def chunked(tokens, chunks, stop_ids, min_new, max_new):
    out, i = [], 0
    for size in chunks:
        new = tokens[i : i + size]
        i += size
        cut = apply_finish_rules(new, len(out), stop_ids, min_new, max_new)
        out.extend(new[: cut.keep])
        if cut.reason:
            assert cut.reason != "stop" or cut.matched == out[-1]
            return out, cut.reason
    return out, None


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 9), min_size=1, max_size=60),
    chunks=st.lists(st.integers(1, 6), min_size=60, max_size=60),
    stop_ids=st.frozensets(st.integers(0, 9), max_size=3),
    min_new=st.integers(0, 10),
    max_new=st.integers(1, 70),
)
def test_chunked_finish_equals_one_at_a_time(tokens, chunks, stop_ids, min_new, max_new):
    assert chunked(tokens, chunks, stop_ids, min_new, max_new) == one_at_a_time(tokens, stop_ids, min_new, max_new)


def test_stop_beats_length_at_the_same_position():
    cut = apply_finish_rules([5, 7, 9], 2, frozenset({9}), 0, 5)
    assert (cut.keep, cut.reason, cut.matched) == (3, "stop", 9)


def test_length_earlier_than_stop_wins():
    cut = apply_finish_rules([5, 7, 9], 3, frozenset({9}), 0, 5)
    assert (cut.keep, cut.reason) == (2, "length")
