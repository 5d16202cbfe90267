"""The FastAPI app: routes, error mapping, and an OpenAPI document that matches what we accept.

Handlers take the raw ``Request`` and decode bodies with msgspec themselves, so FastAPI never
validates (no 422 anywhere); request-body schemas in /openapi.json come from the same Structs.
"""

from __future__ import annotations

import dataclasses
import logging
from importlib import metadata
from typing import Any, Awaitable, Callable

import msgspec
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from tokenizer_proc import serving_native, serving_openai
from tokenizer_proc.context import Front
from tokenizer_proc.errors import APIError, error_body, error_response
from tokenizer_proc.protocol import REQUEST_TYPES

log = logging.getLogger("tandem.front")


def version() -> str:
    try:
        return metadata.version("tandem-serve")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def _error_ref(description: str) -> dict:
    schema = {"$ref": "#/components/schemas/ErrorResponse"}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


ERRORS = {
    400: _error_ref("Invalid request: malformed JSON, wrong content type, a bad field, or too long"),
    404: _error_ref("Unknown model"),
    503: _error_ref("Not ready, draining, engine dead, or overloaded (with Retry-After)"),
}
STREAM_OK = {200: {"description": "JSON, or server-sent events when stream is true",
                   "content": {"application/json": {}, "text/event-stream": {}}}}


def _body(name: str) -> dict:
    ref = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


# The real accepted shapes where msgspec's one-array-per-union rule made the Struct wider.
_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
    {"type": "array", "minItems": 1,
     "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}},
]}


def openapi_schema(app: FastAPI) -> dict:
    schema = get_openapi(title="Tandem", version=version(), routes=app.routes,
                         description="OpenAI-compatible and SGLang-native LLM serving API")
    _, components = msgspec.json.schema_components(REQUEST_TYPES, ref_template="#/components/schemas/{name}")
    components["CompletionRequest"]["properties"]["prompt"] = _PROMPT_SCHEMA
    schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
    return schema


def _json_safe(value: Any) -> Any:
    return msgspec.to_builtins(value, builtin_types=(), str_keys=True) if value is not None else None


def server_info(front: Front) -> dict:
    engine = front.engine
    info, stats = engine.info, engine.last_stats
    accept_len = None
    if stats is not None and stats.spec_num_drafts > 0:
        accept_len = (stats.spec_num_accepted_tokens + stats.spec_num_drafts) / stats.spec_num_drafts
    body: dict[str, Any] = {k: _json_safe(v) for k, v in dataclasses.asdict(front.args).items()}
    body.update(
        version=version(),
        model_name=front.args.model_name,
        status=engine.phase,
        engine_info=_json_safe(info),
        max_total_num_tokens=info.num_pages * info.page_size if info else None,
        max_running_requests=info.max_running_requests if info else front.args.max_running_requests,
        scheduler_stats=_json_safe(stats),
        num_inflight_requests=engine.num_inflight,
        avg_spec_accept_length=accept_len,
        internal_states=[{"avg_spec_accept_length": accept_len,
                          "num_running_reqs": stats.num_running if stats else 0,
                          "num_queue_reqs": stats.num_waiting if stats else 0}],
    )
    return body


def models_body(front: Front) -> dict:
    info = front.engine.info
    card = {"id": front.args.model_name, "object": "model", "created": int(front.engine.started_at),
            "owned_by": "tandem", "root": front.args.model_path, "parent": None,
            "max_model_len": info.max_context if info else front.args.context_length, "permission": []}
    return {"object": "list", "data": [card]}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        return JSONResponse(error_body(400, str(exc)[:500]), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)


Handler = Callable[[Front, Request], Awaitable[Response]]


def build_app(front: Front) -> FastAPI:
    app = FastAPI(title="Tandem", version=version())
    app.state.front = front
    install_error_handlers(app)

    def post(path: str, handler: Handler, body: str, ok: dict | None = None) -> None:
        async def endpoint(request: Request) -> Response:
            return await handler(front, request)

        endpoint.__name__ = handler.__name__ + path.replace("/", "_")
        app.add_api_route(path, endpoint, methods=["POST"], openapi_extra=_body(body),
                          responses={**(ok or {}), **ERRORS})

    post("/v1/completions", serving_openai.create_completion, "CompletionRequest", STREAM_OK)
    post("/v1/chat/completions", serving_openai.create_chat_completion, "ChatCompletionRequest", STREAM_OK)
    post("/generate", serving_native.generate, "GenerateRequest", STREAM_OK)
    for path in ("/tokenize", "/v1/tokenize"):
        post(path, serving_native.tokenize, "TokenizeRequest")
    for path in ("/detokenize", "/v1/detokenize"):
        post(path, serving_native.detokenize, "DetokenizeRequest")

    @app.get("/health", responses={503: ERRORS[503]})
    async def health() -> Response:
        if front.engine.phase == "ready":
            return Response(status_code=200)
        return JSONResponse(error_body(503, f"server is {front.engine.phase}"), status_code=503)

    @app.get("/health_generate", responses={503: ERRORS[503]})
    async def health_generate(request: Request) -> Response:
        return await serving_native.health_generate(front, request)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(front.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def get_version() -> dict:
        return {"version": version()}

    @app.get("/v1/models")
    async def models() -> dict:
        return models_body(front)

    @app.get("/server_info")
    async def get_server_info() -> Response:
        return JSONResponse(server_info(front))

    app.add_api_route("/get_server_info", get_server_info, methods=["GET"], include_in_schema=False)

    @app.get("/model_info")
    async def model_info() -> dict:
        return {"model_path": front.args.model_path, "tokenizer_path": front.args.tokenizer_dir,
                "is_generation": True}

    app.add_api_route("/get_model_info", model_info, methods=["GET"], include_in_schema=False)

    @app.get("/load")
    async def load() -> dict:
        return {"server_load": front.engine.num_inflight}

    @app.post("/flush_cache", responses={503: ERRORS[503]})
    async def flush_cache() -> Response:
        if front.engine.phase == "dead":
            raise APIError(503, f"engine is dead: {front.engine.dead_reason}")
        front.engine.flush_cache()
        return PlainTextResponse("Cache flushed.\n")

    app.add_api_route("/flush_cache", flush_cache, methods=["GET"], include_in_schema=False)

    app.openapi = lambda: app.openapi_schema or _cache_openapi(app)  # type: ignore[method-assign]
    return app


def _cache_openapi(app: FastAPI) -> dict:
    app.openapi_schema = openapi_schema(app)
    return app.openapi_schema
