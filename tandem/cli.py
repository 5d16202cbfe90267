"""The ``tandem`` command."""

from __future__ import annotations

import logging
import sys

from common.args import BUNDLED_MODEL_DIR, ArgError

USAGE = ("usage: tandem serve [MODEL | --model-path DIR|HUB_ID] [--dp-size N] [options]   (tandem serve --help)\n"
         "       tandem router --worker-urls URL... [--policy cache_aware] [options]   (tandem router --help)\n"
         "       tandem keys generate DIR                      (CURVE keys for --transport tcp)\n"
         "       tandem --version")


def version() -> str:
    import importlib.metadata  # noqa: PLC0415 (~4.5 MB resident: only --version asks)

    return importlib.metadata.version("tandem-serve")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("--version", "-V", "version"):
        print(f"tandem {version()}")
        return 0
    if argv[0] == "keys":
        from tandem.keys import main as keys_main

        return keys_main(argv[1:])
    if argv[0] == "router":
        from router.main import main as router_main

        return router_main(argv[1:])
    if argv[0] != "serve":
        print(f"tandem: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    return serve_main(argv[1:])


def serve_main(argv: list[str]) -> int:
    from common.serve_cli import build_parser, parse_server_args
    from tandem.dp import split_router_args

    if "-h" in argv or "--help" in argv:
        build_parser().print_help()
        return 0
    if "--version" in argv:
        print(f"tandem {version()}")
        return 0
    try:
        engine_argv, router_argv = split_router_args(argv)
        args = parse_server_args(engine_argv)
        if router_argv and args.dp_size == 1:
            raise ArgError(f"{router_argv[0].replace('--', '--router-', 1)}: router flags need --dp-size N with N > 1")
    except ArgError as exc:
        print(f"tandem serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _announce(args)
    if args.dp_size > 1:
        from tandem.dp import serve_dp

        return serve_dp(args, engine_argv, router_argv)
    from tandem.supervisor import serve

    return serve(args)


def _announce(args) -> None:
    log = logging.getLogger("tandem")
    if args.model_path.startswith(BUNDLED_MODEL_DIR):
        log.info("no --model-path given: serving the bundled tiny-shakespeare pair from %s "
                 "(Gemma 4 target + frozen-KV MTP assistant; see its README.md)", BUNDLED_MODEL_DIR)
    log.info("model: %s (served as %r)", args.model_path, args.model_name)
    if args.spec_enabled:
        log.info("speculative decoding: %s, draft %s, %d steps", args.speculative_algorithm,
                 args.speculative_draft_model_path, args.speculative_num_steps)


if __name__ == "__main__":
    sys.exit(main())
