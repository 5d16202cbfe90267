"""The fake upstream engine of ``benchmarks/router.py overhead``: a bare ASGI app on uvicorn +
uvloop + httptools that answers at once, so what the benchmark measures is the router's cost.

/health 200, /load idle, /v1/models, and /v1/completions as JSON or 8 SSE events; a body with
``x_ttft_ms`` / ``x_itl_ms`` is paced like an engine (that long to the first event, then one
event per ITL for ``max_tokens`` events).

    python benchmarks/router_fake_upstream.py --port PORT
"""

from __future__ import annotations

import argparse
import asyncio
import json

_JSON = json.dumps({"id": "cmpl-x", "object": "text_completion", "model": "fake",
                    "choices": [{"index": 0, "text": "hello", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}).encode()
_EVENT = b'data: {"object":"text_completion","choices":[{"index":0,"text":"tok","finish_reason":null}]}\n\n'


async def fake_app(scope, receive, send):
    """Answers at once: /health 200, /load idle, /v1/models, completions as JSON or 8 SSE events."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            await send({"type": msg["type"] + ".complete"})
            if msg["type"] == "lifespan.shutdown":
                return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    path = scope["path"]
    ctype, data = b"application/json", b""
    if path == "/load":
        data = b'{"num_running_reqs":0,"num_waiting_reqs":0,"kv_cache_usage_perc":0.0}'
    elif path == "/v1/models":
        data = b'{"object":"list","data":[{"id":"fake","object":"model"}]}'
    elif path == "/v1/completions" and b'"x_ttft_ms"' in body:  # paced like an engine: TTFT, then one event per ITL
        req = json.loads(body)
        await asyncio.sleep(req["x_ttft_ms"] / 1000)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(req["max_tokens"]):
            if i:
                await asyncio.sleep(req["x_itl_ms"] / 1000)
            await send({"type": "http.response.body", "body": _EVENT, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        return
    elif path == "/v1/completions" and (b'"stream": true' in body or b'"stream":true' in body):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(8):
            await send({"type": "http.response.body", "body": _EVENT, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        return
    elif path == "/v1/completions":
        data = _JSON
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def serve_fake(port: int) -> None:
    import uvicorn

    uvicorn.run(fake_app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning",
                access_log=False, backlog=4096)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True)
    serve_fake(p.parse_args().port)
