"""Stop strings: earliest completion wins, exact trimming, no leaks, multi-token chunks.

The reference processes one token at a time and rescans the whole text with a naive search;
the code under test gets the same tokens in random multi-token chunks (speculative decoding).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto.arrays import pack_i32
from proto.messages import ReqOutput, SamplingParams
from tests.unit.front_tok import shared_tokenizer_dir
from tokenizer_proc.detokenize import IncrementalDetokenizer
from tokenizer_proc.formatting import openai_stop_reason
from tokenizer_proc.request_state import RequestState, StopConfig
from tokenizer_proc.stops import StopMatch, StopMatcher
from tokenizer_proc.tokenizer import TextTokenizer

TOK = TextTokenizer(shared_tokenizer_dir("chatml"))
SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ALPHABET = st.sampled_from(list("ab c.!\n") + ["日", "本", "😀", "é"])
texts = st.lists(ALPHABET, min_size=1, max_size=30).map("".join)
stop_lists = st.lists(st.lists(ALPHABET, min_size=1, max_size=4).map("".join), min_size=1, max_size=4)


def naive_first_stop(text: str, stops: list[str]) -> tuple[int, int, str] | None:
    """The smallest end position at which some stop string is complete; ties: the longest."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return end - len(stop), end, stop
    return None


def reference(pieces: list[str], stops: list[str], include: bool) -> tuple[str, int, str | None]:
    """One token at a time: (text, completion tokens, matched stop)."""
    acc = ""
    for i, piece in enumerate(pieces):
        acc += piece
        found = naive_first_stop(acc, stops)
        if found:
            start, end, stop = found
            return acc[: end if include else start], i + 1, stop
    return acc, len(pieces), None


def chunk(seq: list, sizes: list[int]) -> list[list]:
    out, i, k = [], 0, 0
    while i < len(seq):
        n = sizes[k % len(sizes)]
        out.append(seq[i : i + n])
        i, k = i + n, k + 1
    return out


# ---------------------------------------------------------------- StopMatcher alone


@SETTINGS
@given(st.lists(texts, min_size=1, max_size=12), stop_lists, st.booleans())
def test_matcher_equals_reference(pieces, stops, include):
    matcher = StopMatcher(stops, include)
    emitted, n_used, matched = "", 0, None
    for piece in pieces:
        n_used += 1
        result = matcher.feed(piece)
        if isinstance(result, StopMatch):
            emitted += result.emit
            matched = result.stop
            break
        emitted += result
    if matched is None:
        emitted += matcher.flush()
    assert (emitted, n_used, matched) == reference(pieces, stops, include)


def test_earliest_completion_beats_first_listed():
    matcher = StopMatcher(["world", "lo"])
    result = matcher.feed("Hello world")
    assert isinstance(result, StopMatch) and result.stop == "lo" and result.emit == "Hel"


def test_holdback_never_leaks_a_stop_prefix():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("abc S") == "abc "
    assert matcher.feed("T") == ""
    assert matcher.feed("x") == "STx"
    result = matcher.feed("ST")
    assert result == ""
    result = matcher.feed("OP tail")
    assert isinstance(result, StopMatch) and result.emit == ""


def test_include_stop_str_in_output():
    result = StopMatcher(["b."], include_stop_in_output=True).feed("ab.c")
    assert isinstance(result, StopMatch) and result.emit == "ab."


# ---------------------------------------------------------------- through RequestState


def run_state(ids, stops, include, sizes, min_tokens=0):
    params = SamplingParams(max_new_tokens=len(ids), min_new_tokens=min_tokens)
    prompt = TOK.encode("Hi", add_special_tokens=True)
    state = RequestState("r", 0, prompt, params, StopConfig(stops, include), TOK)
    chunks = chunk(ids, sizes)
    deltas = []
    for i, c in enumerate(chunks):
        last = i == len(chunks) - 1
        out = ReqOutput("r", pack_i32(c), finish_reason="length" if last else None)
        delta = state.apply(out)
        if delta is not None:
            deltas.append(delta)
    return state, deltas


def reference_pieces(ids):
    detok = IncrementalDetokenizer(TOK, TOK.encode("Hi", add_special_tokens=True))
    pieces = [detok.add(t) for t in ids]
    pieces[-1] += detok.flush()
    return pieces


@SETTINGS
@given(texts, stop_lists, st.booleans(), st.lists(st.integers(1, 5), min_size=1, max_size=6))
def test_multi_token_chunks_equal_one_token_reference(text, stops, include, sizes):
    ids = TOK.encode(text, add_special_tokens=False)
    state, deltas = run_state(ids, stops, include, sizes)
    ref_text, ref_n, ref_stop = reference(reference_pieces(ids), stops, include)

    assert "".join(d.text for d in deltas) == ref_text
    assert state.n_tokens == ref_n
    assert [t for d in deltas for t in d.token_ids] == ids[:ref_n]
    assert deltas[-1].finish_reason == ("stop" if ref_stop else "length")
    assert deltas[-1].stop_reason == ref_stop
    assert sum(1 for d in deltas if d.finished) == 1
    # Once finished, later outputs (e.g. the scheduler's abort echo) are ignored.
    assert state.apply(ReqOutput("r", pack_i32([1]), finish_reason="abort")) is None


@SETTINGS
@given(texts, st.integers(1, 10))
def test_stop_taken_from_the_text_itself(text, cut):
    """A stop string copied from the middle of the text always fires at its first occurrence."""
    stop = text[min(cut, len(text) - 1) :][:3]
    ids = TOK.encode(text, add_special_tokens=False)
    _, deltas = run_state(ids, [stop], False, [3])
    assert "".join(d.text for d in deltas) == text[: text.find(stop)]
    assert deltas[-1].finish_reason == "stop"


def test_min_tokens_defers_stop_strings():
    ids = TOK.encode("a.b.c.", add_special_tokens=False)
    state, deltas = run_state(ids, ["."], False, [1], min_tokens=len(ids))
    assert "".join(d.text for d in deltas) == "a.b.c"
    assert state.n_tokens == len(ids)


def test_eos_token_counted_but_hidden():
    ids = TOK.encode("Hello", add_special_tokens=False) + [TOK.eos_id]
    params = SamplingParams(max_new_tokens=10)
    state = RequestState("r", 0, [0], params, StopConfig(skip_special_tokens=False), TOK)
    delta = state.apply(ReqOutput("r", pack_i32(ids), finish_reason="stop", matched_stop=TOK.eos_id))
    # The delta keeps the engine's matched id: /generate reports it (SGLang's matched_stop).
    assert delta.text == "Hello" and delta.stop_reason == TOK.eos_id and state.n_tokens == len(ids)
    # The OpenAI endpoints report no stop_reason for the tokenizer's EOS, as vLLM does.
    assert openai_stop_reason(delta.stop_reason, params, TOK.eos_id) is None


def test_openai_stop_reason_rules():
    """vLLM checks the tokenizer's EOS before stop_token_ids: a user stop id equal to EOS reads
    as EOS (null) unless ignore_eos; any other id (a user's, or a generation_config EOS, which
    vLLM folds into stop_token_ids) and stop strings are reported as matched."""
    plain, ignoring = SamplingParams(stop_token_ids=(TOK.eos_id, 7)), SamplingParams(ignore_eos=True)
    assert openai_stop_reason(TOK.eos_id, plain, TOK.eos_id) is None
    assert openai_stop_reason(TOK.eos_id, ignoring, TOK.eos_id) == TOK.eos_id
    assert openai_stop_reason(7, plain, TOK.eos_id) == 7
    assert openai_stop_reason("stop here", plain, TOK.eos_id) == "stop here"
    assert openai_stop_reason(None, plain, TOK.eos_id) is None
    assert openai_stop_reason(TOK.eos_id, plain, None) == TOK.eos_id  # a tokenizer without EOS
