"""What a vLLM user types in the first hour: the flags with no setting here are accepted (their
help says so) or stop with one line saying why, `tandem --version` answers, --device cuda
without a GPU and --max-model-len past the model's limit are one-line errors, and every flag
of `tandem serve` and `tandem router` documents itself and its default."""

from __future__ import annotations

import argparse
import importlib.metadata
import os

import pytest

from common import devices
from common.args import BUNDLED_MODEL_DIR, ArgError
from common.serve_cli import build_parser, parse_server_args
from router.config import build_parser as router_parser
from tandem.cli import main

TARGET = os.path.join(BUNDLED_MODEL_DIR, "target")


def _one_line_error(capsys, argv: list[str], needle: str) -> str:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem serve: error: ") and err.count("\n") == 1 and needle in err, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("habit", [["--disable-log-requests"], ["--enable-chunked-prefill"],
                                   ["--pipeline-parallel-size", "1"], ["-pp", "1"], ["--pipeline-parallel-size=1"]])
def test_habits_with_no_setting_here_are_accepted(habit):
    assert parse_server_args([TARGET, *habit]) == parse_server_args([TARGET])


def test_revision_and_download_dir_are_settings(tmp_path):
    args = parse_server_args([TARGET, "--revision", "v2", "--download-dir", str(tmp_path)])
    assert (args.revision, args.download_dir, args.model_path) == ("v2", str(tmp_path), TARGET)  # local wins


@pytest.mark.parametrize("argv,needle", [
    (["--trust-remote-code"], "--trust-remote-code: no checkpoint code is ever run here"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size: only 1 is supported, got 2"),
    (["-pp", "4"], "--pipeline-parallel-size: only 1 is supported, got 4"),
])
def test_habits_that_cannot_work_stop_with_one_line(capsys, argv, needle):
    _one_line_error(capsys, argv, needle)


@pytest.mark.parametrize("argv", [["--version"], ["-V"], ["serve", "--version"]])
def test_version(capsys, argv):
    assert main(argv) == 0
    assert capsys.readouterr().out == f"tandem {importlib.metadata.version('tandem-serve')}\n"


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_one_line(capsys, monkeypatch, device):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    _one_line_error(capsys, ["--device", device], f"--device {device}: no CUDA GPU is usable here: ")


def test_cuda_index_past_the_visible_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_devices", lambda: devices.CudaDevices(2))
    assert devices.check_cuda_device("cuda:1") is None
    assert "GPU 2 does not exist: 2 visible" in devices.check_cuda_device("cuda:2")


def test_a_cpu_torch_build_has_no_cuda(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.13.0+cpu")
    found = devices.cuda_devices()
    assert found.count == 0 and "2.13.0+cpu is not a CUDA build" in found.why_none


def test_context_length_past_the_model_needs_the_override(capsys):
    """The bundled target's max_position_embeddings is 4096."""
    err = _one_line_error(capsys, ["--max-model-len", "8000"], "--context-length (--max-model-len): 8000 is past")
    assert "max_position_embeddings 4096" in err and "--allow-long-context-length" in err
    assert parse_server_args(["--max-model-len", "4096"]).context_length == 4096
    assert parse_server_args(["--max-model-len", "8000", "--allow-long-context-length"]).context_length == 8000


def _documented(parser: argparse.ArgumentParser) -> list[str]:
    """The flags whose help is missing or does not show the default."""
    bad = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        text = action.help or ""
        undoes = text.startswith("undoes ")  # the off spelling of a switch documents itself
        habit = action.dest.startswith("habit__") or action.dest == "version"
        if not text or not (undoes or habit or "(default: " in text):
            bad.append(action.option_strings[0])
    return bad


def test_every_flag_has_help_and_its_default():
    assert _documented(build_parser()) == []
    assert _documented(router_parser()) == []
    device = next(a for a in build_parser()._actions if "--device" in a.option_strings)
    assert device.metavar == "{auto,cpu,cuda,cuda:N}"
    with pytest.raises(ArgError):  # and a value outside them is refused
        parse_server_args(["--device", "tpu"])
