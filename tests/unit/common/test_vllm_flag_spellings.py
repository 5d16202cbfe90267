"""`tandem serve`'s vLLM spellings: every alias in its `=` and space forms, the
--gpu-memory-utilization range vLLM accepts ((0, 1], 1.0 included), and bad values refused
before anything starts (exit 2, no traceback)."""

from __future__ import annotations

import pytest

from common.args import ArgError
from common.serve_cli import parse_server_args
from tandem.cli import main as cli_main

FORMS = [
    ("--max-model-len", "128", "context_length", 128),
    ("--gpu-memory-utilization", "0.5", "mem_fraction_static", 0.5),
    ("--max-num-seqs", "4", "max_running_requests", 4),
    ("--max-num-batched-tokens", "512", "chunked_prefill_size", 512),
    ("--seed", "3", "random_seed", 3),
    ("--block-size", "32", "page_size", 32),
    ("--tensor-parallel-size", "1", "tp_size", 1),
    ("-tp", "1", "tp_size", 1),
    ("--dtype", "half", "dtype", "float16"),
    ("--reasoning-parser", "deepseek-r1", "reasoning_parser", "deepseek_r1"),
]


@pytest.mark.parametrize("flag,value,field,want", FORMS)
def test_equals_and_space_forms(flag, value, field, want):
    assert getattr(parse_server_args([flag, value]), field) == want
    assert getattr(parse_server_args([f"{flag}={value}"]), field) == want


@pytest.mark.parametrize("value", ["1", "1.0"])
def test_gpu_memory_utilization_one_is_accepted_as_in_vllm(value):
    assert parse_server_args(["--gpu-memory-utilization", value]).mem_fraction_static == 1.0


@pytest.mark.parametrize("value", ["0", "-0.1", "1.01", "nan", "inf"])
def test_gpu_memory_utilization_out_of_range(value, capsys):
    with pytest.raises(ArgError, match="gpu-memory-utilization"):
        parse_server_args([f"--gpu-memory-utilization={value}"])
    assert cli_main(["serve", f"--gpu-memory-utilization={value}"]) == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--chat-template", "/nonexistent/dir/chat.jinja"], ["--chat-template=missing.jinja"],
    ["--chat-template", "{{ unclosed"], ["--reasoning-parser", "deepseek_v3"], ["--max-model-len=abc"],
])
def test_bad_chat_and_vllm_flags_exit_2(argv, capsys):
    assert cli_main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem serve: error:") and "Traceback" not in err


def test_prefix_caching_pair_last_wins():
    assert parse_server_args(["--no-enable-prefix-caching", "--enable-prefix-caching"]).disable_prefix_cache is False
    assert parse_server_args(["--enable-prefix-caching", "--no-enable-prefix-caching"]).disable_prefix_cache is True


@pytest.mark.parametrize("value,want", [("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("1M", 2**20),
                                        ("4096", 4096)])
@pytest.mark.parametrize("flag,field", [("--max-model-len", "context_length"),
                                        ("--max-num-batched-tokens", "chunked_prefill_size")])
def test_vllm_human_readable_token_counts(flag, field, value, want):
    long = ["--allow-long-context-length"]  # the bundled model's max_position_embeddings is 4096
    assert getattr(parse_server_args([flag, value, *long]), field) == want
    assert getattr(parse_server_args([f"{flag}={value}", *long]), field) == want


@pytest.mark.parametrize("value", ["abc", "k", "1.5K", "0x10", "1.2.3k"])
def test_bad_token_counts(value, capsys):
    with pytest.raises(ArgError, match="max-model-len"):
        parse_server_args([f"--max-model-len={value}"])
    assert cli_main(["serve", "--max-model-len", value]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_chat_template_nested_too_deeply_is_a_cli_error(capsys):
    deep = "{% if x %}" * 500 + "{% endif %}" * 500
    with pytest.raises(ArgError, match="--chat-template: does not compile: nested too deeply"):
        parse_server_args(["--chat-template", deep])
    assert cli_main(["serve", "--chat-template", deep]) == 2
    assert "Traceback" not in capsys.readouterr().err
