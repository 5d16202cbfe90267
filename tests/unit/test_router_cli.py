"""Flags of `tandem router` and of `tandem serve --dp-size`: parsing and one-line errors."""

from __future__ import annotations

import pytest

from proto.args import ArgError
from router.config import normalize_url, parse_router_args
from tandem.cli import main
from tandem.dp import split_dp_args


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


def test_split_dp_args():
    dp, engine, router = split_dp_args(["--model-path", "m", "--dp-size", "3", "--router-policy", "round_robin",
                                        "--port", "9000", "--router-disable-retries", "--router-cache-threshold=0.5"])
    assert dp == 3
    assert engine == ["--model-path", "m", "--port", "9000"]
    assert router == ["--policy", "round_robin", "--disable-retries", "--cache-threshold", "0.5"]
    assert split_dp_args(["--dp-size=1"]) == (None, [], [])
    assert split_dp_args(["--port", "1"]) == (None, ["--port", "1"], [])
    with pytest.raises(ArgError, match="--dp-size"):
        split_dp_args(["--dp-size", "x"])
