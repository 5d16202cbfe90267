"""Incremental detokenizer: property tests against a one-shot decode of all tokens."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.unit.front_tok import CORPUS, shared_tokenizer_dir
from tokenizer_proc.detokenize import MAX_PENDING, IncrementalDetokenizer
from tokenizer_proc.tokenizer import TextTokenizer

TOK = TextTokenizer(shared_tokenizer_dir("chatml"))
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Text drawn from characters that byte-level BPE splits across tokens.
ALPHABET = st.sampled_from(list("abc xyz.,!\n") + list("日本語中文东京") + ["😀", "🚀", "👍🏽", "é", "ü", "—"])
texts = st.lists(ALPHABET, min_size=1, max_size=40).map("".join)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.flush())
    return deltas


def test_tokens_split_characters():
    """The fixture is only useful if some tokens really hold partial characters."""
    ids = TOK.encode("😀日本語", add_special_tokens=False)
    assert any("\ufffd" in TOK.token_str(i) for i in ids)


@SETTINGS
@given(texts)
def test_valid_text_roundtrips_without_broken_characters(text):
    ids = TOK.encode(text, add_special_tokens=False)
    deltas = stream(IncrementalDetokenizer(TOK), ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@SETTINGS
@given(st.lists(st.integers(0, TOK.vocab_size - 1), max_size=MAX_PENDING - 1), st.booleans())
def test_random_ids_match_one_shot_decode(ids, skip_special):
    """Any id sequence (broken UTF-8, special tokens) concatenates to the one-shot decode."""
    detok = IncrementalDetokenizer(TOK, skip_special_tokens=skip_special)
    deltas = stream(detok, ids)
    assert "".join(deltas) == TOK.decode(ids, skip_special_tokens=skip_special)
    # Only the final flush may end in a replacement character.
    assert not any(d.endswith("\ufffd") for d in deltas[:-1])


@SETTINGS
@given(texts, texts)
def test_prompt_context_gives_exact_continuation(prompt, completion):
    prompt_ids = TOK.encode(prompt, add_special_tokens=True)
    gen_ids = TOK.encode(completion, add_special_tokens=False)
    deltas = stream(IncrementalDetokenizer(TOK, prompt_ids), gen_ids)
    assert "".join(deltas) == TOK.decode(gen_ids)


@SETTINGS
@given(st.lists(st.integers(0, TOK.vocab_size - 1), min_size=1, max_size=8),
       st.lists(st.integers(0, TOK.vocab_size - 1), max_size=MAX_PENDING - 1))
def test_any_prompt_ids_then_any_completion(prompt_ids, gen_ids):
    """Token-id prompts may end inside a character; the completion must still decode alone."""
    deltas = stream(IncrementalDetokenizer(TOK, prompt_ids), gen_ids)
    assert "".join(deltas) == TOK.decode(gen_ids)


def test_special_tokens_skipped_or_kept():
    ids = TOK.encode("Hello", add_special_tokens=False) + [TOK.eos_id]
    assert "".join(stream(IncrementalDetokenizer(TOK), ids)) == "Hello"
    kept = "".join(stream(IncrementalDetokenizer(TOK, skip_special_tokens=False), ids))
    assert kept == "Hello</s>"


def test_pending_bound_limits_work():
    """Bytes that never complete a character are released after MAX_PENDING tokens."""
    lead = TOK.tok.token_to_id("ð")  # byte 0xF0: a 4-byte lead that never completes here
    assert lead is not None
    detok = IncrementalDetokenizer(TOK)
    out = [detok.add(lead) for _ in range(MAX_PENDING + 2)]
    assert "".join(out).startswith("\ufffd")


@pytest.fixture(scope="module")
def metaspace_tok():
    """A SentencePiece-style tokenizer: the decoder drops the leading space of the first token,
    so decoding a token without left context gives the wrong spacing."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", *byte_tokens], show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


class _RawDecoder:
    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["Hello world", "The dog", "To be"]), st.sampled_from([" the lazy dog", " or not", " sleeps."]))
def test_metaspace_leading_spaces(metaspace_tok, prompt, completion):
    dec = _RawDecoder(metaspace_tok)
    prompt_ids = metaspace_tok.encode(prompt).ids
    full_ids = metaspace_tok.encode(prompt + completion).ids
    if full_ids[: len(prompt_ids)] != prompt_ids:
        return  # the merge crossed the boundary; not a continuation
    gen_ids = full_ids[len(prompt_ids) :]
    text = "".join(stream(IncrementalDetokenizer(dec, prompt_ids), gen_ids))
    assert text == dec.decode(full_ids)[len(dec.decode(prompt_ids)) :]
    assert text.startswith(" ")
