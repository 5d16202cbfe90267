"""``tandem router --api-key`` (or TANDEM_API_KEY): the engines' key, on the router too.

Behind ``tandem serve --dp-size N --api-key KEY`` the router is the public door. The engines
check the key on what the router forwards, but the router answers some routes itself:
``/workers`` (add a worker: point traffic, prompts included, at any URL), ``/flush_cache``,
``/v1/models``. So the router requires ``Authorization: Bearer KEY`` on every route but its
probes and scrape (/health, /liveness, /readiness, /metrics; closed too with
``--metrics-require-key``), compared in constant time, 401 in the OpenAI error shape before
the body is read. It also sends the key on its own calls to the engines (health checks,
/v1/models, /load, /flush_cache), which are keyed alike.

A copy of the front's middleware rather than an import: the router imports only proto/.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health", "/liveness", "/readiness", "/metrics"})


def bearer_token(authorization: str | None) -> bytes | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode("utf-8", "surrogateescape")


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, protect_ops: bool = False):
        self.app = app
        self.key = api_key.encode("utf-8")
        self.open_paths = frozenset() if protect_ops else OPEN_PATHS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        token = bearer_token(Headers(scope=scope).get("authorization"))
        # compare_digest takes the same time wherever the first difference is.
        if token is not None and hmac.compare_digest(token, self.key):
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send 'Authorization: Bearer <key>'" if token is None
                   else "invalid API key")
        body = {"error": {"message": message, "type": "AuthenticationError", "param": None, "code": 401}}
        await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
