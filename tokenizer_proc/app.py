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

from common.auth import APIKeyMiddleware
from tokenizer_proc import serving_chat, serving_native, serving_openai
from tokenizer_proc.context import Front
from tokenizer_proc.errors import APIError, error_body, error_response
from tokenizer_proc.params import check_model
from tokenizer_proc.protocol import REQUEST_TYPES, TOKEN_ID_MAX

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
    401: _error_ref("Missing or wrong API key (with --api-key)"),
    404: _error_ref("Unknown model"),
    413: _error_ref("Request body larger than --max-request-body-bytes"),
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
    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": TOKEN_ID_MAX}},
    {"type": "array", "minItems": 1,
     "items": {"type": "array", "minItems": 1,
               "items": {"type": "integer", "minimum": 0, "maximum": TOKEN_ID_MAX}}},
]}


def _exactly_one(a: dict, b: dict) -> dict:
    """One of two properties ({name: schema} each) must be set, the other absent or null."""
    (na, sa), (nb, sb) = next(iter(a.items())), next(iter(b.items()))
    null = {"type": "null"}
    return {"oneOf": [{"required": [na], "properties": {na: sa, nb: null}},
                      {"required": [nb], "properties": {nb: sb, na: null}}]}


def _limit_token_ids(node: Any, vocab: int) -> None:
    """Token ids must be below the engine's vocabulary; known only once the engine is up."""
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("maximum") == TOKEN_ID_MAX:
            node["maximum"] = vocab - 1
        for value in node.values():
            _limit_token_ids(value, vocab)
    elif isinstance(node, list):
        for value in node:
            _limit_token_ids(value, vocab)


def _limit_lengths(components: dict, max_context: int) -> None:
    """No completion can be longer than the context (the prompt's share is checked per request)."""
    for struct in components.values():
        for name in ("max_tokens", "max_completion_tokens", "max_new_tokens"):
            prop = struct.get("properties", {}).get(name)
            for option in (prop or {}).get("anyOf", []):
                if option.get("type") == "integer":
                    option["maximum"] = max_context


def openapi_schema(app: FastAPI, vocab_size: int | None = None, max_context: int | None = None) -> dict:
    schema = get_openapi(title="Tandem", version=version(), routes=app.routes,
                         description="OpenAI-compatible and SGLang-native LLM serving API")
    _, components = msgspec.json.schema_components(REQUEST_TYPES, ref_template="#/components/schemas/{name}")
    components["CompletionRequest"]["properties"]["prompt"] = _PROMPT_SCHEMA
    nonempty_str = {"type": "string", "minLength": 1}
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": TOKEN_ID_MAX}}
    components["GenerateRequest"].update(_exactly_one({"text": nonempty_str}, {"input_ids": ids}))
    components["TokenizeRequest"].update(_exactly_one({"prompt": {"type": "string"}},
                                                      {"messages": {"type": "array"}}))
    # Messages are validated as ChatMessage but passed on as dicts (extra keys reach the template).
    messages = {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/ChatMessage"}}
    components["ChatCompletionRequest"]["properties"]["messages"] = messages
    components["TokenizeRequest"]["properties"]["messages"] = {"anyOf": [messages, {"type": "null"}],
                                                               "default": None}
    if vocab_size:
        for name in ("CompletionRequest", "ChatCompletionRequest", "GenerateRequest", "DetokenizeRequest",
                     "NativeSamplingParams"):
            _limit_token_ids(components[name], vocab_size)
    if max_context:
        _limit_lengths(components, max_context)
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
    if body.get("api_key") is not None:
        body["api_key"] = "<redacted>"
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
    """One card per served name (vLLM lists each ``--served-model-name``), the response name first."""
    info = front.engine.info
    cards = [{"id": name, "object": "model", "created": int(front.engine.started_at),
              "owned_by": "tandem", "root": front.args.model_path, "parent": None,
              "max_model_len": info.max_context if info else front.args.context_length, "permission": []}
             for name in front.args.model_names]
    return {"object": "list", "data": cards}


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


def load_body(front: Front) -> dict:
    """GET /load: what a router needs to pick an engine (SGLang's /get_load fields plus ours)."""
    engine = front.engine
    stats = engine.last_stats
    kv = stats.kv_pages_used / stats.kv_pages_total if stats and stats.kv_pages_total else 0.0
    return {"server_load": engine.num_inflight, "num_requests_running": engine.num_running,
            "num_requests_waiting": engine.num_waiting, "num_inflight_requests": engine.num_inflight,
            "num_running_reqs": engine.num_running, "num_waiting_reqs": engine.num_waiting,  # SGLang's names
            "max_queued_requests": front.args.max_queued_requests, "kv_cache_usage_perc": kv,
            "status": engine.phase}


def build_app(front: Front) -> FastAPI:
    app = FastAPI(title="Tandem", version=version())
    app.state.front = front
    install_error_handlers(app)
    if front.args.api_key is not None:
        # /load stays open too: routers poll it.
        app.add_middleware(APIKeyMiddleware, api_key=front.args.api_key,
                           open_paths=frozenset({"/health", "/metrics", "/load"}),
                           protect_ops=front.args.metrics_require_key)

    def post(path: str, handler: Handler, body: str, ok: dict | None = None) -> None:
        async def endpoint(request: Request) -> Response:
            return await handler(front, request)

        endpoint.__name__ = handler.__name__ + path.replace("/", "_")
        app.add_api_route(path, endpoint, methods=["POST"], openapi_extra=_body(body),
                          responses={**(ok or {}), **ERRORS})

    post("/v1/completions", serving_openai.create_completion, "CompletionRequest", STREAM_OK)
    post("/v1/chat/completions", serving_chat.create_chat_completion, "ChatCompletionRequest", STREAM_OK)
    post("/generate", serving_native.generate, "GenerateRequest", STREAM_OK)
    for path in ("/tokenize", "/v1/tokenize"):
        post(path, serving_native.tokenize, "TokenizeRequest")
    for path in ("/detokenize", "/v1/detokenize"):
        post(path, serving_native.detokenize, "DetokenizeRequest")

    @app.get("/health", response_class=Response, responses={200: {"description": "Ready (empty body)"},
                                                             503: ERRORS[503]})
    async def health() -> Response:
        if front.engine.phase == "ready":
            return Response(status_code=200)
        return JSONResponse(error_body(503, f"server is {front.engine.phase}"), status_code=503)

    @app.get("/health_generate", response_class=Response,
             responses={200: {"description": "A 1-token request went round the engine"}, 503: ERRORS[503]})
    async def health_generate(request: Request) -> Response:
        return await serving_native.health_generate(front, request)

    @app.get("/metrics", response_class=Response,
             responses={200: {"description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST: {}}}})
    async def metrics() -> Response:
        return Response(front.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def get_version() -> dict:
        return {"version": version()}

    @app.get("/v1/models")
    async def models() -> dict:
        return models_body(front)

    # OpenAI's models.retrieve; a :path because served names may hold a slash (org/model). The
    # id is read from the request, not declared as a FastAPI parameter: that would add a 422.
    model_param = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}

    @app.get("/v1/models/{model:path}", responses={404: ERRORS[404]}, openapi_extra={"parameters": [model_param]})
    async def retrieve_model(request: Request) -> dict:
        name = request.path_params["model"]
        check_model(name, front.args.model_names)
        return next(card for card in models_body(front)["data"] if card["id"] == name)

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
        return load_body(front)

    @app.post("/flush_cache", response_class=PlainTextResponse, responses={503: ERRORS[503]})
    async def flush_cache() -> Response:
        if front.engine.phase == "dead":
            raise APIError(503, f"engine is dead: {front.engine.dead_reason}")
        front.engine.flush_cache()
        return PlainTextResponse("Cache flushed.\n")

    app.add_api_route("/flush_cache", flush_cache, methods=["GET"], include_in_schema=False)

    def openapi() -> dict:
        # Cached only once the engine is known: its vocabulary bounds token ids in the schema.
        if app.openapi_schema is None:
            info = front.engine.info
            schema = openapi_schema(app, info.vocab_size if info else None, info.max_context if info else None)
            if info is None:
                return schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
