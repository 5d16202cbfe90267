"""``tandem router``: parse flags, serve the router with uvicorn (uvloop + httptools when present)."""

from __future__ import annotations

import importlib.util
import logging
import sys

from common.args import ArgError
from router.config import RouterConfig, build_parser, parse_router_args

log = logging.getLogger("tandem.router")


def run(cfg: RouterConfig) -> int:
    import uvicorn

    from router.app import Router, build_app

    app = build_app(Router(cfg))
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, loop=loop, http=http, log_level=cfg.log_level,
                            access_log=False, timeout_keep_alive=30, timeout_graceful_shutdown=30,
                            backlog=4096)
    server = uvicorn.Server(config)
    log.info("router (%s) on http://%s:%d in front of %d worker(s): %s", cfg.policy, cfg.host, cfg.port,
             len(cfg.worker_urls), ", ".join(cfg.worker_urls) or "none yet (POST /workers)")
    server.run()
    return 0 if server.started else 1


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        build_parser().print_help()
        return 0
    try:
        cfg = parse_router_args(argv)
    except ArgError as exc:
        print(f"tandem router: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
