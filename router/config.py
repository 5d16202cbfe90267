"""RouterConfig: the router's frozen configuration and its command-line parser.

Flags and defaults follow SGLang's Model Gateway (``sglang_router.launch_router``) where it
has one: cache threshold 0.3, balance thresholds 64 / 1.5, eviction every 120 s, tree cap
2^26 characters, 5 retries from 50 ms, circuit breaker 5 failures / 2 successes / 30 s.
A bad value raises ``ArgError`` whose message names the flag.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from common.args import LOG_LEVELS, ArgError

_HOST_RE = re.compile(r"[A-Za-z0-9._-]+|[0-9A-Fa-f:.]+")
POLICIES = ("cache_aware", "power_of_two", "round_robin", "random", "consistent_hash")


@dataclass(frozen=True)
class RetryConfig:
    max_retries: int = 5  # extra attempts after the first
    initial_backoff_ms: float = 50.0
    max_backoff_ms: float = 30_000.0
    backoff_multiplier: float = 1.5
    jitter_factor: float = 0.2  # each wait is scaled by a uniform factor in [1 - j, 1 + j]
    enabled: bool = True


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = 5  # failures within the window that open the breaker
    success_threshold: int = 2  # half-open successes that close it
    timeout_s: float = 30.0  # open -> half-open after this long
    window_s: float = 60.0  # failures older than this are forgotten
    enabled: bool = True


@dataclass(frozen=True)
class CacheAwareConfig:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 120.0
    max_tree_size: int = 2**26  # characters per worker
    max_prefix_chars: int = 8192  # routed text is cut here: the cost per request stays flat
    # An engine whose own queue or KV usage says it is hot loses its affinity (beyond SGLang).
    hot_waiting_threshold: int = 8
    hot_kv_usage: float = 0.95


@dataclass(frozen=True)
class RouterConfig:
    worker_urls: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 30000
    policy: str = "cache_aware"
    request_timeout_s: float = 1800.0  # whole upstream exchange, to a stream's last byte
    connect_timeout_s: float = 5.0
    health_check_interval_s: float = 5.0
    health_check_timeout_s: float = 5.0
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    health_check_endpoint: str = "/health"
    load_poll_interval_s: float = 0.5  # engine /load (running, waiting, KV usage)
    max_connections: int = 4096
    max_request_body_bytes: int = 8 * 1024 * 1024  # beyond it 413, before buffering more (the engines' default)
    log_level: str = "info"
    routing_key_headers: tuple[str, ...] = ("x-session-id", "x-smg-routing-key", "x-user-id")
    request_id_headers: tuple[str, ...] = ("x-request-id", "x-correlation-id", "x-trace-id")
    retry: RetryConfig = field(default_factory=RetryConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    cache: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    api_key: str | None = field(default=None, repr=False)  # common/auth.py; or TANDEM_API_KEY
    metrics_require_key: bool = False


def normalize_url(url: str, flag: str = "--worker-urls") -> str:
    """``host:port`` or ``http://host:port[/]`` -> ``http://host:port``; anything else is an error."""
    raw = url.strip()
    if "://" not in raw:
        raw = "http://" + raw
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname or not _HOST_RE.fullmatch(parts.hostname):
        raise ArgError(f"{flag}: {url!r} is not an http(s) URL")
    try:
        port = parts.port
    except ValueError:
        raise ArgError(f"{flag}: {url!r} has a bad port") from None
    if parts.query or parts.fragment or parts.path not in ("", "/"):
        raise ArgError(f"{flag}: {url!r} must be scheme://host:port with no path")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port else "")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise ArgError(message)


def build_parser(prog: str = "tandem router") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description="Route OpenAI-compatible requests across Tandem engines.")
    a = p.add_argument
    a("--worker-urls", nargs="*", default=[], help="engine base URLs (more can be added at run time: POST /workers)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=30000)
    a("--policy", default="cache_aware", help="|".join(POLICIES))
    a("--request-timeout-secs", "--request-timeout", type=float, default=1800.0)
    a("--connect-timeout-secs", type=float, default=5.0)
    a("--health-check-interval-secs", "--health-check-interval", type=float, default=5.0)
    a("--health-check-timeout-secs", type=float, default=5.0)
    a("--health-failure-threshold", type=int, default=3)
    a("--health-success-threshold", type=int, default=2)
    a("--health-check-endpoint", default="/health")
    a("--load-poll-interval-secs", type=float, default=0.5)
    a("--max-connections", type=int, default=4096)
    a("--max-request-body-bytes", type=int, default=8 * 1024 * 1024,
      help="larger request bodies get 413 before they are buffered (default: the engines' 8 MiB)")
    a("--log-level", default="info")
    a("--cache-threshold", type=float, default=0.3)
    a("--balance-abs-threshold", type=int, default=64)
    a("--balance-rel-threshold", type=float, default=1.5)
    a("--eviction-interval-secs", "--eviction-interval", type=float, default=120.0)
    a("--max-tree-size", type=int, default=2**26)
    a("--max-prefix-chars", type=int, default=8192)
    a("--hot-waiting-threshold", type=int, default=8)
    a("--hot-kv-usage", type=float, default=0.95)
    a("--retry-max-retries", type=int, default=5)
    a("--retry-initial-backoff-ms", type=float, default=50.0)
    a("--retry-max-backoff-ms", type=float, default=30_000.0)
    a("--retry-backoff-multiplier", type=float, default=1.5)
    a("--retry-jitter-factor", type=float, default=0.2)
    a("--disable-retries", action="store_true")
    a("--cb-failure-threshold", type=int, default=5)
    a("--cb-success-threshold", type=int, default=2)
    a("--cb-timeout-duration-secs", type=float, default=30.0)
    a("--cb-window-duration-secs", type=float, default=60.0)
    a("--disable-circuit-breaker", action="store_true")
    a("--api-key", default=None, help="require 'Authorization: Bearer KEY' (and send it to the engines); "
                                      "or set TANDEM_API_KEY")
    a("--metrics-require-key", action="store_true", help="require the key on /health, /metrics ... too")
    return p


def _check(cfg: RouterConfig) -> RouterConfig:
    def positive(flag: str, value: float, allow_zero: bool = False) -> None:
        if value < 0 or (value == 0 and not allow_zero):
            raise ArgError(f"{flag}: must be {'non-negative' if allow_zero else 'positive'}, got {value}")

    if cfg.policy not in POLICIES:
        raise ArgError(f"--policy: expected one of {', '.join(POLICIES)}, got {cfg.policy!r}")
    if not 0 < cfg.port < 65536:
        raise ArgError(f"--port: must be in 1..65535, got {cfg.port}")
    if cfg.log_level not in LOG_LEVELS:
        raise ArgError(f"--log-level: expected one of {', '.join(LOG_LEVELS)}, got {cfg.log_level!r}")
    if not 0.0 <= cfg.cache.cache_threshold <= 1.0:
        raise ArgError(f"--cache-threshold: must be in [0, 1], got {cfg.cache.cache_threshold}")
    if not 0.0 < cfg.cache.hot_kv_usage <= 1.0:
        raise ArgError(f"--hot-kv-usage: must be in (0, 1], got {cfg.cache.hot_kv_usage}")
    if cfg.cache.balance_rel_threshold < 1.0:
        raise ArgError(f"--balance-rel-threshold: must be >= 1, got {cfg.cache.balance_rel_threshold}")
    if not 0.0 <= cfg.retry.jitter_factor < 1.0:
        raise ArgError(f"--retry-jitter-factor: must be in [0, 1), got {cfg.retry.jitter_factor}")
    if cfg.retry.backoff_multiplier < 1.0:
        raise ArgError(f"--retry-backoff-multiplier: must be >= 1, got {cfg.retry.backoff_multiplier}")
    for flag, value in (("--request-timeout-secs", cfg.request_timeout_s),
                        ("--connect-timeout-secs", cfg.connect_timeout_s),
                        ("--health-check-interval-secs", cfg.health_check_interval_s),
                        ("--health-check-timeout-secs", cfg.health_check_timeout_s),
                        ("--load-poll-interval-secs", cfg.load_poll_interval_s),
                        ("--eviction-interval-secs", cfg.cache.eviction_interval_s),
                        ("--max-tree-size", cfg.cache.max_tree_size),
                        ("--max-prefix-chars", cfg.cache.max_prefix_chars),
                        ("--max-connections", cfg.max_connections),
                        ("--max-request-body-bytes", cfg.max_request_body_bytes),
                        ("--health-failure-threshold", cfg.health_failure_threshold),
                        ("--health-success-threshold", cfg.health_success_threshold),
                        ("--cb-failure-threshold", cfg.breaker.failure_threshold),
                        ("--cb-success-threshold", cfg.breaker.success_threshold),
                        ("--cb-timeout-duration-secs", cfg.breaker.timeout_s),
                        ("--cb-window-duration-secs", cfg.breaker.window_s),
                        ("--retry-max-backoff-ms", cfg.retry.max_backoff_ms)):
        positive(flag, value)
    positive("--retry-max-retries", cfg.retry.max_retries, allow_zero=True)
    positive("--retry-initial-backoff-ms", cfg.retry.initial_backoff_ms, allow_zero=True)
    positive("--balance-abs-threshold", cfg.cache.balance_abs_threshold, allow_zero=True)
    positive("--hot-waiting-threshold", cfg.cache.hot_waiting_threshold, allow_zero=True)
    if cfg.api_key is not None and not cfg.api_key.strip():
        raise ArgError("--api-key: must not be empty")
    if cfg.metrics_require_key and cfg.api_key is None:
        raise ArgError("--metrics-require-key: needs --api-key (or TANDEM_API_KEY)")
    if not cfg.health_check_endpoint.startswith("/"):
        raise ArgError(f"--health-check-endpoint: must start with '/', got {cfg.health_check_endpoint!r}")
    return cfg


def parse_router_args(argv: list[str]) -> RouterConfig:
    ns = build_parser().parse_args(argv)
    urls = tuple(dict.fromkeys(normalize_url(u) for u in ns.worker_urls))
    api_key = ns.api_key if ns.api_key is not None else os.environ.get("TANDEM_API_KEY") or None
    return _check(RouterConfig(
        worker_urls=urls, host=ns.host, port=ns.port, policy=ns.policy,
        request_timeout_s=ns.request_timeout_secs, connect_timeout_s=ns.connect_timeout_secs,
        health_check_interval_s=ns.health_check_interval_secs, health_check_timeout_s=ns.health_check_timeout_secs,
        health_failure_threshold=ns.health_failure_threshold, health_success_threshold=ns.health_success_threshold,
        health_check_endpoint=ns.health_check_endpoint, load_poll_interval_s=ns.load_poll_interval_secs,
        max_connections=ns.max_connections, max_request_body_bytes=ns.max_request_body_bytes,
        log_level=ns.log_level,
        retry=RetryConfig(max_retries=ns.retry_max_retries, initial_backoff_ms=ns.retry_initial_backoff_ms,
                          max_backoff_ms=ns.retry_max_backoff_ms, backoff_multiplier=ns.retry_backoff_multiplier,
                          jitter_factor=ns.retry_jitter_factor, enabled=not ns.disable_retries),
        breaker=BreakerConfig(failure_threshold=ns.cb_failure_threshold, success_threshold=ns.cb_success_threshold,
                              timeout_s=ns.cb_timeout_duration_secs, window_s=ns.cb_window_duration_secs,
                              enabled=not ns.disable_circuit_breaker),
        cache=CacheAwareConfig(cache_threshold=ns.cache_threshold, balance_abs_threshold=ns.balance_abs_threshold,
                               balance_rel_threshold=ns.balance_rel_threshold,
                               eviction_interval_s=ns.eviction_interval_secs, max_tree_size=ns.max_tree_size,
                               max_prefix_chars=ns.max_prefix_chars, hot_waiting_threshold=ns.hot_waiting_threshold,
                               hot_kv_usage=ns.hot_kv_usage),
        api_key=api_key, metrics_require_key=ns.metrics_require_key,
    ))
