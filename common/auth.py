"""``--api-key``: ``Authorization: Bearer KEY`` on every route but the operational ones, for
the engine's front and the router alike (both import it from here: the process packages share only proto/ and common/).

A pure ASGI middleware (streams pass through untouched). The key is compared in constant time
(``hmac.compare_digest`` on bytes), so response timing says nothing about how much of a guess
was right. The caller names the open paths (probes, scrapers, routers' load polls), closed too
with ``--metrics-require-key``. A refusal is 401 in the OpenAI error shape with
``WWW-Authenticate: Bearer`` (RFC 6750), before the body is read.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send


def bearer_token(authorization: str | None) -> bytes | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode("utf-8", "surrogateescape")


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str], protect_ops: bool = False):
        self.app = app
        self.key = api_key.encode("utf-8")
        self.open_paths = frozenset() if protect_ops else open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        token = bearer_token(Headers(scope=scope).get("authorization"))
        # compare_digest runs in time independent of where the first difference is.
        if token is not None and hmac.compare_digest(token, self.key):
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send 'Authorization: Bearer <key>'" if token is None
                   else "invalid API key")
        body = {"error": {"message": message, "type": "AuthenticationError", "param": None, "code": 401}}
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
