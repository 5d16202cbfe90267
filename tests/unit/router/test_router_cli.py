"""Flags of `tandem router` and of `tandem serve --dp-size`: parsing and one-line errors."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from common.args import ArgError
from router.config import normalize_url, parse_router_args
from tandem.cli import main
from common.serve_cli import parse_server_args
from tandem.dp import split_router_args


def test_router_defaults_follow_sglang():
    cfg = parse_router_args(["--worker-urls", "127.0.0.1:8001", "http://localhost:8002/"])
    assert cfg.worker_urls == ("http://127.0.0.1:8001", "http://localhost:8002")
    assert cfg.policy == "cache_aware"
    c = cfg.cache
    assert (c.cache_threshold, c.balance_abs_threshold, c.balance_rel_threshold, c.eviction_interval_s,
            c.max_tree_size) == (0.3, 64, 1.5, 120.0, 2**26)
    assert (cfg.retry.max_retries, cfg.retry.initial_backoff_ms) == (5, 50.0)
    b = cfg.breaker
    assert (b.failure_threshold, b.success_threshold, b.timeout_s, b.window_s) == (5, 2, 30.0, 60.0)


@pytest.mark.parametrize("argv, flag", [
    (["--policy", "fastest"], "--policy"),
    (["--cache-threshold", "1.5"], "--cache-threshold"),
    (["--port", "0"], "--port"),
    (["--retry-jitter-factor", "1"], "--retry-jitter-factor"),
    (["--health-check-interval-secs", "0"], "--health-check-interval-secs"),
    (["--worker-urls", "ftp://x:1"], "--worker-urls"),
    (["--worker-urls", "http://x:1/v1"], "--worker-urls"),
    (["--balance-rel-threshold", "0.5"], "--balance-rel-threshold"),
])
def test_router_bad_flags_name_the_flag(argv, flag):
    with pytest.raises(ArgError, match=flag):
        parse_router_args(argv)


def test_normalize_url():
    assert normalize_url("http://[::1]:8000") == "http://[::1]:8000"
    assert normalize_url("https://engine-0.svc:443") == "https://engine-0.svc:443"
    with pytest.raises(ArgError):
        normalize_url("http://bad host:1")


def test_cli_errors_are_one_line(capsys):
    assert main(["router", "--policy", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem router: error: --policy") and err.count("\n") == 1
    assert main(["serve", "--dp-size", "0"]) == 2
    assert "--dp-size" in capsys.readouterr().err
    assert main(["serve", "--router-policy", "random"]) == 2
    assert "--router-policy" in capsys.readouterr().err
    assert main(["router", "--help"]) == 0
    assert "--cache-threshold" in capsys.readouterr().out
    assert main(["serve", "--help"]) == 0
    assert "--dp-size" in capsys.readouterr().out


def test_split_router_args():
    engine, router = split_router_args(["--model-path", "m", "--dp-size", "3", "--router-policy", "round_robin",
                                        "--port", "9000", "--router-disable-retries", "--router-cache-threshold=0.5"])
    assert engine == ["--model-path", "m", "--dp-size", "3", "--port", "9000"]
    assert router == ["--policy", "round_robin", "--disable-retries", "--cache-threshold", "0.5"]
    assert split_router_args(["--port", "1"]) == (["--port", "1"], [])
    assert parse_server_args(["--dp-size=3"]).dp_size == parse_server_args(["--data-parallel-size", "3"]).dp_size == 3
    with pytest.raises(ArgError, match="--dp-size"):
        parse_server_args(["--dp-size", "x"])


def _last(cmd: list[str], flag: str) -> str:
    """The value after the last use of ``flag`` (argparse: the last one wins)."""
    return cmd[len(cmd) - cmd[::-1].index(flag)]


def test_dp_engines_listen_on_predictable_ports(monkeypatch, tmp_path):
    """Engine i on --dp-base-port + i (default --port + 1), its own seed, a share of the cores."""
    from tandem.dp import DataParallel, _gpu_ids

    argv = ["--run-dir", str(tmp_path), "--port", "9000", "--seed", "7", "--dp-size", "2"]
    dp = DataParallel(parse_server_args(argv), argv, [])
    monkeypatch.setattr("os.cpu_count", lambda: 9)
    cmd = dp._engine_cmd(1, cpu=True)
    assert cmd[cmd.index("serve") + 1:cmd.index("serve") + 1 + len(argv)] == argv
    last = lambda flag: _last(cmd, flag)  # noqa: E731
    assert (last("--port"), last("--host"), last("--num-threads"), last("--dp-size")) == ("9002", "127.0.0.1", "4", "1")
    assert last("--run-dir") == str(tmp_path / "dp1") and "--device" not in cmd
    engine = parse_server_args(cmd[cmd.index("serve") + 1:])
    assert engine.random_seed == 8 and engine.dp_size == 1 and engine.port == 9002  # engine i: seed + i
    based = DataParallel(parse_server_args([*argv, "--dp-base-port", "7100"]), argv, [])
    assert [_last(based._engine_cmd(i, cpu=True), "--port") for i in (0, 1)] == ["7100", "7101"]
    gpu = dp._engine_cmd(0, cpu=False)
    assert gpu[gpu.index("--device") + 1] == "cuda" and "--num-threads" not in gpu
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    assert _gpu_ids(2) == ["3", "5"]
    with pytest.raises(ArgError, match="--dp-size: 4 engines need 4 GPUs, 3 visible"):
        _gpu_ids(4)


def test_router_api_key_flags(monkeypatch):
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    assert parse_router_args([]).api_key is None
    cfg = parse_router_args(["--api-key", "k1", "--metrics-require-key"])
    assert (cfg.api_key, cfg.metrics_require_key) == ("k1", True) and "k1" not in repr(cfg)
    monkeypatch.setenv("TANDEM_API_KEY", "k2")
    assert parse_router_args([]).api_key == "k2"
    with pytest.raises(ArgError, match="--api-key"):
        parse_router_args(["--api-key", " "])
    monkeypatch.delenv("TANDEM_API_KEY")
    with pytest.raises(ArgError, match="--metrics-require-key"):
        parse_router_args(["--metrics-require-key"])


def test_dp_hands_the_api_key_to_the_router(monkeypatch):
    """--dp-size with --api-key: the router child gets the key (in its environment, not its
    argv) and --metrics-require-key, so it guards its own routes and can talk to the engines."""
    from tandem import dp as dp_mod

    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    started = []

    class FakePopen:
        def __init__(self, cmd, env=None, preexec_fn=None, stdout=None, stderr=None):
            started.append((cmd, env or {}))
            self.stdout = io.BytesIO()

    monkeypatch.setattr(dp_mod.subprocess, "Popen", FakePopen)
    argv = ["--device", "cpu", "--api-key", "sekrit", "--metrics-require-key", "--dp-size", "2"]
    dp_mod.DataParallel(parse_server_args(argv), argv, []).start()
    (router_cmd, router_env), engines = started[-1], started[:-1]
    assert "router" in router_cmd and "--metrics-require-key" in router_cmd and "sekrit" not in router_cmd
    assert router_env["TANDEM_API_KEY"] == "sekrit"
    assert all("--api-key" in cmd for cmd, _ in engines) and len(engines) == 2


def test_the_dp_supervisor_imports_no_torch():
    """`tandem serve --dp-size 2` parses, finds its device and starts its children without
    importing torch (224 MB for a process that runs no model)."""
    code = (
        "import subprocess, sys, io\n"
        "class P:\n"
        "    def __init__(self, *a, **k): self.stdout = io.BytesIO()\n"
        "subprocess.Popen = P\n"
        "from tandem.cli import main\n"
        "import tandem.dp as dp\n"
        "dp.serve_dp = lambda args, e, r: dp.DataParallel(args, e, r).start() or 0\n"
        "assert main(['serve', '--dp-size', '2', '--log-level', 'warning']) == 0\n"
        "import tandem.supervisor\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'gpu_worker', 'transformers')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
