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

from common.args import LOG_LEVELS
from common.flags import ArgError, Parser, add_flags, check_numbers, formatter, given_values, opt

_HOST_RE = re.compile(r"[A-Za-z0-9._-]+|[0-9A-Fa-f:.]+")
POLICIES = ("cache_aware", "power_of_two", "round_robin", "random", "consistent_hash")

ROUTING, HEALTH, CACHE, RETRY, BREAKER, SERVER = (
    "routing", "health checks and load polls", "cache_aware policy", "retries (before the first byte only)",
    "circuit breaker (per worker)", "server")


@dataclass(frozen=True)
class RetryConfig:
    max_retries: int = opt(5, "--retry-max-retries", group=RETRY, metavar="N",
                           help="extra attempts after the first (on 408/429/5xx, connect errors, timeouts)")
    initial_backoff_ms: float = opt(50.0, "--retry-initial-backoff-ms", group=RETRY, metavar="MS",
                                    help="the first wait between attempts")
    max_backoff_ms: float = opt(30_000.0, "--retry-max-backoff-ms", group=RETRY, metavar="MS", positive=True,
                                help="the longest wait between attempts")
    backoff_multiplier: float = opt(1.5, "--retry-backoff-multiplier", group=RETRY, metavar="X",
                                    help="each wait is the previous one times this")
    jitter_factor: float = opt(0.2, "--retry-jitter-factor", group=RETRY, metavar="J",
                               help="each wait is scaled by a uniform factor in [1 - J, 1 + J]")
    enabled: bool = opt(True, "--disable-retries", group=RETRY, invert=True,
                        help="send each request once")


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = opt(5, "--cb-failure-threshold", group=BREAKER, metavar="N", positive=True,
                                 help="failures (5xx, timeouts, transport errors) within the window that open it")
    success_threshold: int = opt(2, "--cb-success-threshold", group=BREAKER, metavar="N", positive=True,
                                 help="half-open successes that close it")
    timeout_s: float = opt(30.0, "--cb-timeout-duration-secs", group=BREAKER, metavar="S", positive=True,
                           help="open -> half-open after this long")
    window_s: float = opt(60.0, "--cb-window-duration-secs", group=BREAKER, metavar="S", positive=True,
                          help="failures older than this are forgotten")
    enabled: bool = opt(True, "--disable-circuit-breaker", group=BREAKER, invert=True,
                        help="never take a worker out of rotation for its failures")


@dataclass(frozen=True)
class CacheAwareConfig:
    cache_threshold: float = opt(0.3, "--cache-threshold", group=CACHE, metavar="F",
                                 help="the worker whose tree matches more than this share of the routed text "
                                 "gets it; below it, the worker with the smallest tree")
    balance_abs_threshold: int = opt(64, "--balance-abs-threshold", group=CACHE, metavar="N",
                                     help="the load spread (max - min) beyond which ...")
    balance_rel_threshold: float = opt(1.5, "--balance-rel-threshold", group=CACHE, metavar="X",
                                       help="... and the ratio (max / min) beyond which the least loaded worker "
                                       "gets the request, whatever the cache")
    eviction_interval_s: float = opt(120.0, "--eviction-interval-secs", "--eviction-interval", group=CACHE,
                                     metavar="S", positive=True,
                                     help="how often each worker's tree is cut back to --max-tree-size")
    max_tree_size: int = opt(2**26, "--max-tree-size", group=CACHE, metavar="CHARS", positive=True,
                             default_text="2^26 = 67108864",
                             help="characters kept per worker's tree (evicted least recently used first)")
    max_prefix_chars: int = opt(8192, "--max-prefix-chars", group=CACHE, metavar="CHARS", positive=True,
                                help="routed text is cut here, so the cost per request stays flat")
    # An engine whose own queue or KV usage says it is hot loses its affinity (beyond SGLang).
    hot_waiting_threshold: int = opt(8, "--hot-waiting-threshold", group=CACHE, metavar="N",
                                     help="an engine with more waiting requests than this loses its cache "
                                     "affinity to the least loaded engine that is not hot")
    hot_kv_usage: float = opt(0.95, "--hot-kv-usage", group=CACHE, metavar="F",
                              help="... as does one whose KV cache is at least this full")


@dataclass(frozen=True)
class RouterConfig:
    worker_urls: tuple[str, ...] = opt((), "--worker-urls", group=ROUTING, metavar="URL", nargs="*",
                                       help="engine base URLs, host:port or http(s)://host:port (more can be added "
                                       "at run time: POST /workers)")
    policy: str = opt("cache_aware", "--policy", group=ROUTING, metavar="NAME", choices=POLICIES,
                      help="how a worker is picked")
    request_timeout_s: float = opt(1800.0, "--request-timeout-secs", "--request-timeout", group=ROUTING,
                                   metavar="S", positive=True,
                                   help="the whole upstream exchange, to a stream's last byte")
    connect_timeout_s: float = opt(5.0, "--connect-timeout-secs", group=ROUTING, metavar="S", positive=True,
                                   help="connecting to an engine")
    max_connections: int = opt(4096, "--max-connections", group=ROUTING, metavar="N", positive=True,
                               help="pooled upstream connections, all engines together")
    health_check_interval_s: float = opt(5.0, "--health-check-interval-secs", "--health-check-interval",
                                         group=HEALTH, metavar="S", positive=True, help="between health checks")
    health_check_timeout_s: float = opt(5.0, "--health-check-timeout-secs", group=HEALTH, metavar="S",
                                        positive=True, help="one health check")
    health_failure_threshold: int = opt(3, "--health-failure-threshold", group=HEALTH, metavar="N", positive=True,
                                        help="failed checks in a row that eject a worker (one refused connection "
                                        "does too)")
    health_success_threshold: int = opt(2, "--health-success-threshold", group=HEALTH, metavar="N", positive=True,
                                        help="passed checks in a row that re-admit an ejected worker")
    health_check_endpoint: str = opt("/health", "--health-check-endpoint", group=HEALTH, metavar="PATH",
                                     help="the path checked")
    load_poll_interval_s: float = opt(0.5, "--load-poll-interval-secs", group=HEALTH, metavar="S", positive=True,
                                      help="between polls of each engine's /load (running, waiting, KV usage)")
    host: str = opt("127.0.0.1", "--host", group=SERVER, metavar="ADDR", help="the HTTP address to listen on")
    port: int = opt(30000, "--port", group=SERVER, metavar="PORT", help="the HTTP port")
    max_request_body_bytes: int = opt(8 * 1024 * 1024, "--max-request-body-bytes", group=SERVER, metavar="N",
                                      positive=True, default_text="8 MiB, the engines'",
                                      help="larger request bodies get 413 before they are buffered")
    log_level: str = opt("info", "--log-level", group=SERVER, metavar="LEVEL", choices=LOG_LEVELS,
                         help="the router's log level")
    engine_metrics: bool = opt(False, "--engine-metrics", group=SERVER,
                               help="also serve every healthy engine's /metrics series on /metrics, each labelled "
                               "engine=host:port (tandem serve --dp-size turns it on: its engines listen on "
                               "loopback only)")
    api_key: str | None = opt(None, "--api-key", group=SERVER, metavar="KEY", secret=True,
                              default_text="none, or $TANDEM_API_KEY",
                              help="require 'Authorization: Bearer KEY' (and send it to the engines)")
    metrics_require_key: bool = opt(False, "--metrics-require-key", group=SERVER,
                                    help="require the key on /health, /metrics ... too")
    routing_key_headers: tuple[str, ...] = ("x-session-id", "x-smg-routing-key", "x-user-id")
    request_id_headers: tuple[str, ...] = ("x-request-id", "x-correlation-id", "x-trace-id")
    retry: RetryConfig = field(default_factory=RetryConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    cache: CacheAwareConfig = field(default_factory=CacheAwareConfig)


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


def build_parser(prog: str = "tandem router") -> argparse.ArgumentParser:
    p = Parser(prog=prog, usage=f"{prog} --worker-urls URL... [options]", formatter_class=formatter, description="Route OpenAI-compatible requests across Tandem "
               "engines. Flags and defaults follow SGLang's Model Gateway.")
    add_flags(p, RouterConfig)
    return p


def _check(cfg: RouterConfig) -> RouterConfig:
    check_numbers(cfg)  # every `positive` and `choices` of the field declarations
    if not 0 < cfg.port < 65536:
        raise ArgError(f"--port: must be in 1..65535, got {cfg.port}")
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
    for flag, value in (("--retry-max-retries", cfg.retry.max_retries),
                        ("--retry-initial-backoff-ms", cfg.retry.initial_backoff_ms),
                        ("--balance-abs-threshold", cfg.cache.balance_abs_threshold),
                        ("--hot-waiting-threshold", cfg.cache.hot_waiting_threshold)):
        if value < 0:
            raise ArgError(f"{flag}: must be non-negative, got {value}")
    if cfg.api_key is not None and not cfg.api_key.strip():
        raise ArgError("--api-key: must not be empty")
    if cfg.metrics_require_key and cfg.api_key is None:
        raise ArgError("--metrics-require-key: needs --api-key (or TANDEM_API_KEY)")
    if not cfg.health_check_endpoint.startswith("/"):
        raise ArgError(f"--health-check-endpoint: must start with '/', got {cfg.health_check_endpoint!r}")
    return cfg


def parse_router_args(argv: list[str]) -> RouterConfig:
    kw = given_values(RouterConfig, build_parser().parse_args(argv))
    kw["worker_urls"] = tuple(dict.fromkeys(normalize_url(u) for u in kw.get("worker_urls", ())))
    if kw.get("api_key") is None:
        kw["api_key"] = os.environ.get("TANDEM_API_KEY") or None
    return _check(RouterConfig(**kw))
