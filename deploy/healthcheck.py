#!/usr/bin/env python3
"""Container health probe: exit 0 when GET <url> answers 200, else 1.

The images ship no curl (python:3.11-slim has none), so the Dockerfile's HEALTHCHECK and the
compose healthchecks run this with the image's own interpreter. It uses only the standard
library, so it works before and after the venv is on PATH.

    tandem-healthcheck [URL]      default: $TANDEM_HEALTH_URL or http://127.0.0.1:8000/health

With $TANDEM_API_KEY set (the server's key) the probe sends it, so ``--metrics-require-key``,
which closes /health too, does not leave the container unhealthy.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/health"


def main(argv: list[str]) -> int:
    url = argv[1] if len(argv) > 1 else os.environ.get("TANDEM_HEALTH_URL", DEFAULT_URL)
    key = os.environ.get("TANDEM_API_KEY")
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=float(os.environ.get("TANDEM_HEALTH_TIMEOUT", "4"))) as resp:
            ok = resp.status == 200
    except (urllib.error.URLError, OSError, ValueError) as exc:  # 503 arrives as HTTPError (a URLError)
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    if not ok:
        print(f"unhealthy: {url}: HTTP {resp.status}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
