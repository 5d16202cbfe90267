"""Reasoning parsers (qwen3, deepseek_r1): where an answer starts (the prompt, the parser's
default, enable_thinking), the split of a whole answer against a plain reference, and the stream
equal to the whole answer however the text is cut (every split point, every three-way split of
short texts, one character at a time, random chunks)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenizer_proc.reasoning import CLOSE, OPEN, ReasoningParser, split_reasoning, starts_in_reasoning
from tokenizer_proc.tool_parsers import accumulate, parse_complete, parser_class

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
QWEN_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def reference(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """The rule, written without streaming: an optional leading <think> (after whitespace) is
    dropped, reasoning runs to the first </think>, the rest is content."""
    if not in_reasoning:
        return None, text
    if text.lstrip().startswith(OPEN):
        text = text.lstrip()[len(OPEN):]
    reasoning, tag, content = text.partition(CLOSE)
    return reasoning, content


def stream(pieces: list[str], in_reasoning: bool) -> tuple[str, str, list]:
    parser = ReasoningParser(in_reasoning)
    outs = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(o.reasoning for o in outs), "".join(o.content for o in outs), outs


def assert_any_cut(text: str, in_reasoning: bool, three_way: bool = False) -> None:
    want_r, want_c = split_reasoning(ReasoningParser(in_reasoning), text)
    assert (want_r, want_c) == reference(text, in_reasoning)
    cuts = [(i,) for i in range(len(text) + 1)]
    if three_way:
        cuts += list(itertools.combinations(range(len(text) + 1), 2))
    pieces_list = [[text[a:b] for a, b in itertools.pairwise([0, *c, len(text)])] for c in cuts] + [list(text)]
    for pieces in pieces_list:
        got_r, got_c, outs = stream(pieces, in_reasoning)
        assert (got_r, got_c) == (want_r or "", want_c), pieces
        # reasoning never follows content: once content started, the block is over
        seen_content = False
        for o in outs:
            assert not (seen_content and o.reasoning), pieces
            seen_content = seen_content or bool(o.content)


@pytest.mark.parametrize("text,in_reasoning,want", [
    ("<think>\nLet me see.\n</think>\n\nIt is 42.", True, ("\nLet me see.\n", "\n\nIt is 42.")),
    ("Let me see.</think>It is 42.", True, ("Let me see.", "It is 42.")),  # R1: no opening tag
    ("\n<think>x</think>y", True, ("x", "y")),  # whitespace before the model's own tag goes with it
    ("<think></think>", True, ("", "")),
    ("still thinking when the cap hit", True, ("still thinking when the cap hit", "")),
    ("a </think> b </think> c", True, ("a ", " b </think> c")),  # later tags are content
    ("x <think> y</think>z", True, ("x <think> y", "z")),  # a tag inside reasoning is text
    ("<thinking>no tag</think>ok", True, ("<thinking>no tag", "ok")),
    ("</thin", True, ("</thin", "")),  # a partial tag at the end is text
    ("<thi", True, ("<thi", "")),
    ("   ", True, ("   ", "")),
    ("<think>a</think>b", False, (None, "<think>a</think>b")),  # content from the start: no parsing
    ("", True, ("", "")),
])
def test_split_and_every_cut(text, in_reasoning, want):
    assert split_reasoning(ReasoningParser(in_reasoning), text) == want
    assert_any_cut(text, in_reasoning, three_way=len(text) <= 30)


def test_unicode_and_long_text_any_cut():
    text = "<think>日本語 😀 reasoning\n" + "step " * 20 + "</think>答え: 42 👍🏽"
    assert_any_cut(text, True)


@pytest.mark.parametrize("name,prompt,kwargs,cont,want", [
    ("deepseek_r1", "<｜User｜>Hi<｜Assistant｜><think>\n", None, False, True),  # R1 template opens it
    ("deepseek_r1", "<｜User｜>Hi<｜Assistant｜>", None, False, True),  # R1 writes no opening tag
    ("deepseek_r1", "<｜User｜>Hi<｜Assistant｜></think>", None, False, False),  # closed by the template
    ("qwen3", QWEN_PROMPT, None, False, True),  # current vLLM: thinking on unless disabled
    ("qwen3", QWEN_PROMPT, {"enable_thinking": True}, False, True),
    ("qwen3", QWEN_PROMPT, {"enable_thinking": False}, False, False),
    ("deepseek_r1", QWEN_PROMPT, {"enable_thinking": False}, False, True),  # only qwen3 reads it
    ("qwen3", QWEN_PROMPT + "<think>\n\n</think>\n\n", None, False, False),  # Qwen3 enable_thinking=false
    ("qwen3", QWEN_PROMPT + "<think>\n", {"enable_thinking": False}, False, True),  # the prompt decides
    # an earlier turn's closed block followed by more prompt: the parser's default decides
    ("qwen3", "<think>a</think>b<|im_end|>\n" + QWEN_PROMPT, None, False, True),
    ("qwen3", "<think>a</think>b<|im_end|>\n" + QWEN_PROMPT, {"enable_thinking": False}, False, False),
    # continue_final_message: the continued answer's own tags decide
    ("qwen3", QWEN_PROMPT + "<think>half a thought", None, True, True),
    ("deepseek_r1", QWEN_PROMPT + "<think>done</think>The answer", None, True, False),
    ("deepseek_r1", QWEN_PROMPT + "<think>done</think>The answer", None, False, True),
])
def test_where_the_answer_starts(name, prompt, kwargs, cont, want):
    assert starts_in_reasoning(name, prompt, kwargs, cont) is want


PIECES = ["<think>", "</think>", "<", "/", "think", ">", "<th", "ink>", "</", "\n", " ", "a", "é", "😀", "<tool_call>"]
chunk_sizes = st.lists(st.integers(1, 9), min_size=1, max_size=8)


def cut_sized(text: str, sizes: list[int]) -> list[str]:
    out, i, k = [], 0, 0
    while i < len(text):
        out.append(text[i:i + sizes[k % len(sizes)]])
        i, k = i + sizes[k % len(sizes)], k + 1
    return out


@SETTINGS
@given(st.lists(st.sampled_from(PIECES), max_size=30).map("".join), chunk_sizes, st.booleans())
def test_any_text_any_chunking(text, sizes, in_reasoning):
    want_r, want_c = reference(text, in_reasoning)
    assert split_reasoning(ReasoningParser(in_reasoning), text) == (want_r, want_c)
    got_r, got_c, _ = stream(cut_sized(text, sizes), in_reasoning)
    assert (got_r, got_c) == (want_r or "", want_c)


COMPOSED = ["<think>", "</think>", "<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"x": 1}}', "{", "}",
            "\n", " ", "a", "<", "/", "😀"]


@SETTINGS
@given(st.lists(st.sampled_from(COMPOSED), max_size=25).map("".join), chunk_sizes, st.booleans())
def test_reasoning_then_tool_parser_any_chunking(text, sizes, in_reasoning):
    """The serving order (reasoning parser, then the tool parser on its content only): the
    stream, cut anywhere, folds into the non-streaming answer unless a call broke mid-stream."""
    want_r, want_c = split_reasoning(ReasoningParser(in_reasoning), text)
    want = parse_complete(parser_class("hermes")(), want_c)
    reasoner, tools = ReasoningParser(in_reasoning), parser_class("hermes")()
    reasoning, outs = "", []
    for piece in [*cut_sized(text, sizes), None]:
        out = reasoner.feed(piece) if piece is not None else reasoner.finish()
        reasoning += out.reasoning
        outs.append(tools.feed(out.content))
    outs.append(tools.finish())
    got = accumulate(outs)
    assert reasoning == (want_r or "")
    if tools.broken is None:
        assert (got.content, [(c.name, c.arguments) for c in got.tool_calls]) == \
            (want.content, [(c.name, c.arguments) for c in want.tool_calls])
