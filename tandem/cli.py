"""The ``tandem`` command."""

from __future__ import annotations

import logging
import sys

from common.args import BUNDLED_MODEL_DIR, ArgError, parse_server_args

USAGE = ("usage: tandem serve [MODEL | --model-path DIR] [--dp-size N] [options]   (tandem serve --help)\n"
         "       tandem router --worker-urls URL... [--policy cache_aware] [options]   (tandem router --help)\n"
         "       tandem keys generate DIR                      (CURVE keys for --transport tcp)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "keys":
        from tandem.keys import main as keys_main

        return keys_main(argv[1:])
    if argv[0] == "router":
        from router.main import main as router_main

        return router_main(argv[1:])
    if argv[0] != "serve":
        print(f"tandem: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    if "-h" in argv[1:] or "--help" in argv[1:]:
        from common.args import build_parser

        build_parser().print_help()
        from tandem.dp import DP_HELP

        print(DP_HELP)
        return 0
    from tandem.dp import split_dp_args

    try:
        dp, engine_argv, router_argv = split_dp_args(argv[1:])
        args = parse_server_args(engine_argv)
    except ArgError as exc:
        print(f"tandem serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _announce(args)
    if dp is not None:
        from tandem.dp import serve_dp

        return serve_dp(dp, args, engine_argv, router_argv)
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
