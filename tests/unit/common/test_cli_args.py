"""`tandem serve`'s vLLM spellings parse to the same ServerArgs as the SGLang ones, the chat
flags (--chat-template, --trust-request-chat-template, --reasoning-parser) are checked before
anything starts, and --help shows each alias next to its flag."""

from __future__ import annotations

import os

import pytest

from common.args import BUNDLED_MODEL_DIR, ArgError
from common.parsers import REASONING_PARSERS
from common.serve_cli import parse_server_args
from tandem.cli import main as cli_main

TARGET = os.path.join(BUNDLED_MODEL_DIR, "target")


@pytest.mark.parametrize("vllm,sglang", [
    (["--model", TARGET], ["--model-path", TARGET]),
    ([TARGET], ["--model-path", TARGET]),
    ([TARGET, "--port", "9000"], ["--port", "9000", "--model-path", TARGET]),
    (["--port", "9000", TARGET], ["--model-path", TARGET, "--port", "9000"]),
    ([TARGET, "--model", TARGET], ["--model-path", TARGET]),
    (["--tokenizer", TARGET], ["--tokenizer-path", TARGET]),
    (["--max-model-len", "512"], ["--context-length", "512"]),
    (["--gpu-memory-utilization", "0.5"], ["--mem-fraction-static", "0.5"]),
    (["--tensor-parallel-size", "2"], ["--tp-size", "2"]),
    (["-tp", "2"], ["--tp-size", "2"]),
    (["-tp=2"], ["--tp-size", "2"]),
    (["--max-num-seqs", "7"], ["--max-running-requests", "7"]),
    (["--max-num-batched-tokens", "1024"], ["--chunked-prefill-size", "1024"]),
    (["--enforce-eager"], ["--disable-cuda-graph"]),
    (["--seed", "42"], ["--random-seed", "42"]),
    (["--block-size", "32"], ["--page-size", "32"]),
    (["--no-enable-prefix-caching"], ["--disable-prefix-cache"]),
    (["--enable-prefix-caching"], []),
    (["--disable-prefix-cache", "--enable-prefix-caching"], []),
    (["--enable-prefix-caching", "--no-enable-prefix-caching"], ["--disable-radix-cache"]),
    (["--reasoning-parser", "deepseek-r1"], ["--reasoning-parser", "deepseek_r1"]),
    (["--dtype", "half"], ["--dtype", "float16"]),
    (["--dtype", "float"], ["--dtype", "float32"]),
])
def test_vllm_spelling_parses_like_sglang(vllm, sglang):
    assert parse_server_args(vllm) == parse_server_args(sglang)


def test_aliases_change_what_they_should():
    base = parse_server_args([])
    got = parse_server_args(["--max-model-len", "512", "--gpu-memory-utilization", "0.5", "-tp", "2",
                             "--max-num-seqs", "7", "--max-num-batched-tokens", "1024", "--enforce-eager",
                             "--seed", "42", "--no-enable-prefix-caching", "--block-size", "32"])
    assert got == base.replace(context_length=512, mem_fraction_static=0.5, tp_size=2, max_running_requests=7,
                               chunked_prefill_size=1024, disable_cuda_graph=True, random_seed=42,
                               disable_prefix_cache=True, page_size=32)
    positional = parse_server_args([TARGET])
    assert positional.model_path == TARGET and positional.served_model_name is None
    assert not positional.spec_enabled  # an explicit model: no bundled assistant


def test_positional_model_and_a_different_flag_conflict():
    with pytest.raises(ArgError, match="^--model-path: .* differs from the positional MODEL"):
        parse_server_args([TARGET, "--model-path", BUNDLED_MODEL_DIR])


def test_reasoning_parser_names(tmp_path):
    for name in REASONING_PARSERS:
        assert parse_server_args(["--reasoning-parser", name]).reasoning_parser == name
    with pytest.raises(ArgError, match="^--reasoning-parser: expected one of deepseek_r1, qwen3, got 'nope'"):
        parse_server_args(["--reasoning-parser", "nope"])


def test_chat_template_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert parse_server_args(["--chat-template", str(path)]).chat_template == str(path)
    inline = "{{ messages[0]['content'] }}"
    assert parse_server_args(["--chat-template", inline]).chat_template == inline
    assert parse_server_args(["--trust-request-chat-template"]).trust_request_chat_template


@pytest.mark.parametrize("value,needle", [
    ("missing/template.jinja", "--chat-template: 'missing/template.jinja' looks like a file path but cannot be read"),
    ("{% for m in messages %}", "--chat-template: does not compile: "),
    ("{{ x ", "--chat-template: does not compile: "),
])
def test_bad_chat_template_is_a_one_line_cli_error(capsys, value, needle):
    assert cli_main(["serve", "--chat-template", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem serve: error: " + needle) and err.count("\n") == 1, err


def test_bad_template_file_is_a_cli_error(tmp_path):
    path = tmp_path / "bad.jinja"
    path.write_text("{% if %}")
    with pytest.raises(ArgError, match="^--chat-template: does not compile: .*line 1"):
        parse_server_args(["--chat-template", str(path)])
    with pytest.raises(ArgError, match="^--chat-template: .* cannot be read .*IsADirectoryError"):
        parse_server_args(["--chat-template", str(tmp_path)])


def test_help_shows_aliases_next_to_the_flag(capsys):
    assert cli_main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for pair in ("--model-path DIR|HUB_ID, --model DIR|HUB_ID", "--tokenizer-path DIR|HUB_ID, --tokenizer DIR|HUB_ID",
                 "--context-length N, --max-model-len N", "--mem-fraction-static F, --gpu-memory-utilization F",
                 "--tp-size N, --tensor-parallel-size N, --tp N, -tp N", "--max-running-requests N, --max-num-seqs N",
                 "--chunked-prefill-size N, --max-num-batched-tokens N", "--disable-cuda-graph, --enforce-eager",
                 "--random-seed N, --seed N", "--no-enable-prefix-caching", "--enable-prefix-caching",
                 "--chat-template FILE|JINJA", "--trust-request-chat-template", "--reasoning-parser NAME"):
        assert pair in out, pair
    assert out.startswith("usage: tandem serve [MODEL] [--model-path DIR|HUB_ID] [options]\n")
    assert max(len(line) for line in out.splitlines()) <= 100


def test_several_served_model_names():
    """vLLM's ``--served-model-name a b``: responses carry the first, requests may use any."""
    one = parse_server_args([TARGET, "--served-model-name", "qwen3"])
    assert one.model_names == ("qwen3",) and one.served_model_aliases == ()
    many = parse_server_args([TARGET, "--served-model-name", "qwen3", "org/qwen3-8b", "qwen3", "q"])
    assert many.model_name == "qwen3" and many.model_names == ("qwen3", "org/qwen3-8b", "q")
    assert parse_server_args([TARGET]).model_names == (TARGET,)
    assert parse_server_args(["--served-model-name", "a", "b"]).model_names == ("a", "b")  # the bundled pair
