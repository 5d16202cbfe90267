"""Errors in vLLM's shape: ``{"error": {"message", "type", "param", "code"}}``, ``code`` = HTTP status.

Every request problem the front detects is an ``APIError``; handlers raise it and the app turns it
into a JSON response (before streaming) or an SSE error event (after the 200 went out).
"""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec
from fastapi.responses import JSONResponse

T = TypeVar("T")

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}
# Overload and not-ready answers tell clients when to come back.
RETRY_AFTER_S = "1"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, retry_after: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after or status == 503

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    etype = ERROR_TYPES.get(status, "BadRequestError" if 400 <= status < 500 else "InternalServerError")
    return {"error": {"message": message, "type": etype, "param": param, "code": status}}


def error_response(err: APIError) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER_S} if err.retry_after else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


_PATH_RE = re.compile(r" - at `\$\.?(.*)`$")
_MISSING_RE = re.compile(r"missing required field `([^`]+)`")


def _param_from_validation(message: str) -> tuple[str, str | None]:
    """msgspec says 'Expected `int` >= 0 - at `$.max_tokens`'; split off the field path."""
    m = _PATH_RE.search(message)
    if m:
        # a dict's value is `$.logit_bias[...]` (msgspec names no key): the field is the param
        path = m.group(1).removesuffix("[...]") or None
        missing = _MISSING_RE.search(message)
        if missing:
            path = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return message[: m.start()], path
    missing = _MISSING_RE.search(message)
    return message, missing.group(1) if missing else None


def decode_body(body: bytes, typ: type[T]) -> T:
    """JSON bytes -> Struct, or APIError(400) naming the offending field."""
    if not body.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        # Lax coercion, like pydantic's default in vLLM: "16" and 16.0 are fine for an int field
        # (JSON Schema calls 16.0 an integer too); "sixteen" and 16.5 are not.
        return msgspec.json.decode(body, type=typ, strict=False)
    except msgspec.ValidationError as exc:
        message, param = _param_from_validation(str(exc))
        where = f" (field '{param}')" if param else ""
        raise bad_request(f"invalid request: {message}{where}", param) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"malformed JSON: {exc}") from None
    except RecursionError:
        raise bad_request("malformed JSON: nested too deeply") from None


def check_content_type(content_type: str | None) -> None:
    """JSON bodies only. A missing header is tolerated (curl -d, some SDKs omit it)."""
    if not content_type:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise bad_request(f"unsupported Content-Type {media!r}; expected application/json")
