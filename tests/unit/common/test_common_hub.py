"""Hub ids as checkpoint paths (common/hub.py), with no network: a pre-populated cache in the
Hub's snapshot layout serves under HF_HUB_OFFLINE; an id that is not there is one clear line;
a local directory of the same name wins; --revision, the tokenizer and the draft resolve too."""

from __future__ import annotations

import os
import subprocess
import sys

import huggingface_hub.constants
import pytest

from common.args import BUNDLED_MODEL_DIR, ArgError, ServerArgs
from common.hub import looks_like_hub_id
from common.serve_cli import parse_server_args, prepare_server_args
from tests.helpers.hub_cache import add_to_cache
from tests.helpers.server import ROOT

TARGET = os.path.join(BUNDLED_MODEL_DIR, "target")
ASSISTANT = os.path.join(BUNDLED_MODEL_DIR, "assistant")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline HF home holding org/tiny (main and v1) and org/tiny-draft."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    home = str(tmp_path / "hf")
    snaps = {"main": add_to_cache(home, "org/tiny", TARGET), "v1": add_to_cache(home, "org/tiny", TARGET, "v1"),
             "draft": add_to_cache(home, "org/tiny-draft", ASSISTANT)}
    return os.path.join(home, "hub"), snaps


def test_a_cached_id_resolves_to_its_snapshot_and_keeps_its_name(hub):
    cache, snaps = hub
    args = parse_server_args(["org/tiny", "--download-dir", cache])
    assert args.model_path == snaps["main"] and args.tokenizer_dir == snaps["main"]
    assert args.model_name == "org/tiny" and not args.spec_enabled
    named = parse_server_args(["--model", "org/tiny", "--download-dir", cache, "--served-model-name", "t"])
    assert named.model_names == ("t",)
    assert parse_server_args(["org/tiny", "--download-dir", cache, "--revision", "v1"]).model_path == snaps["v1"]


def test_a_server_args_built_in_python_resolves_the_same(hub):
    """tandem.LLM's path: a ServerArgs from keyword arguments, then the chain tandem serve runs."""
    cache, snaps = hub
    args = prepare_server_args(ServerArgs(model_path="org/tiny", download_dir=cache, device="cpu"))
    assert args == parse_server_args(["org/tiny", "--download-dir", cache, "--device", "cpu"])
    assert args.model_path == snaps["main"] and args.model_name == "org/tiny"


def test_tokenizer_and_draft_paths_resolve_too(hub):
    cache, snaps = hub
    args = parse_server_args(["org/tiny", "--tokenizer", "org/tiny-draft", "--download-dir", cache,
                              "--speculative-algorithm", "frozen-kv-mtp", "--speculative-draft-model-path",
                              "org/tiny-draft"])
    assert args.tokenizer_path == snaps["draft"] and args.speculative_draft_model_path == snaps["draft"]
    assert args.speculative_algorithm == "FROZEN-KV-MTP"


def test_an_unknown_id_is_one_line_naming_it_why_and_what_to_do(hub):
    cache, _ = hub
    with pytest.raises(ArgError) as err:
        parse_server_args(["org/nope", "--download-dir", cache])
    msg = str(err.value)
    assert msg.startswith("--model-path: 'org/nope' is not a local directory and the Hugging Face Hub could not")
    assert "HF_HUB_OFFLINE is set" in msg and cache in msg and "pass its directory" in msg and "\n" not in msg
    with pytest.raises(ArgError, match="^--model-path: 'org/tiny' .* not in the cache"):
        parse_server_args(["org/tiny", "--download-dir", cache, "--revision", "v9"])


def test_a_local_directory_wins(hub, tmp_path, monkeypatch):
    cache, _ = hub
    monkeypatch.chdir(tmp_path)
    os.makedirs("org")
    os.symlink(TARGET, "org/tiny")
    args = parse_server_args(["org/tiny", "--download-dir", cache])
    assert args.model_path == "org/tiny" and args.model_name == "org/tiny"


@pytest.mark.parametrize("path,is_id", [("Qwen/Qwen3-0.6B", True), ("gpt2", True), ("./gpt2", False),
                                        ("/abs/dir", False), ("a/b/c", False), ("~/m", False), ("../m", False)])
def test_what_reads_as_an_id(path, is_id):
    assert looks_like_hub_id(path) is is_id


def test_the_cli_reads_hf_home_and_hf_hub_offline(tmp_path):
    """Through the environment as users set it: the cached id validates, the unknown one exits 2
    with the line (no traceback)."""
    home = str(tmp_path / "hf")
    add_to_cache(home, "org/tiny", TARGET)
    env = {**os.environ, "HF_HOME": home, "HF_HUB_OFFLINE": "1"}
    code = ("import sys; from common.serve_cli import parse_server_args; from tandem.cli import main\n"
            "print(parse_server_args(['org/tiny']).model_path)\n"
            "sys.exit(main(['serve', 'org/nope']))\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert run.stdout.startswith(os.path.join(home, "hub", "models--org--tiny", "snapshots"))
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("tandem serve: error: --model-path: 'org/nope'")
    assert "HF_HUB_OFFLINE is set" in run.stderr
