"""``tandem keys generate DIR``: the CURVE key set for tcp:// engine channels (proto/curve.py)."""

from __future__ import annotations

import sys

USAGE = "usage: tandem keys generate DIR"


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "generate":
        print(USAGE, file=sys.stderr)
        return 2
    from proto.curve import CurveKeyError, generate_keys  # noqa: PLC0415

    try:
        keys = generate_keys(argv[1])
    except (CurveKeyError, OSError) as exc:
        print(f"tandem keys: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote a CURVE key set to {argv[1]} (server public key {keys.server_public.decode()});\n"
          f"serve with: tandem serve --transport tcp --curve-keys-dir {argv[1]}\n"
          "give every engine process this directory; binders need server.key_secret, connectors "
          "client.key_secret and server.key. More client public keys go in authorized_clients/.")
    return 0
