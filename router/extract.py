"""What the router reads from a request body: routed text, model, stream flag, routing key.

The router never tokenises and never validates: a body it cannot read is still forwarded and
the engine answers it with its own 400. Routed text is the prompt (completions), the
concatenated text of the messages (chat), or ``text`` / ``input_ids`` (native ``/generate``);
token ids become one character each (a private alphabet, so they never match real text).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

_decoder = msgspec.json.Decoder()
_IDS_MARK = "\x00ids\x00"


@dataclass(frozen=True)
class RequestFacts:
    text: str = ""
    model: str | None = None
    stream: bool = False
    user: str | None = None


def _ids_text(ids: list) -> str:
    try:
        return _IDS_MARK + "".join(chr(0xF0000 + (int(t) & 0xFFFF)) for t in ids)
    except (TypeError, ValueError):
        return ""


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first  # a batch routes by its first prompt; the engine serves the whole batch
        if isinstance(first, int):
            return _ids_text(prompt)
        if isinstance(first, list):
            return _ids_text(first)
    return ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: take the text parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _messages_text(messages: Any, limit: int) -> str:
    if not isinstance(messages, list):
        return ""
    parts: list[str] = []
    size = 0
    for m in messages:
        if not isinstance(m, dict):
            continue
        piece = f"<|{m.get('role', '')}|>{_content_text(m.get('content'))}"
        parts.append(piece)
        size += len(piece)
        if size >= limit:  # the tail cannot matter past the bounded prefix
            break
    return "".join(parts)


def read_facts(path: str, body: bytes, limit: int) -> RequestFacts:
    try:
        obj = _decoder.decode(body)
    except msgspec.DecodeError:
        return RequestFacts()
    if not isinstance(obj, dict):
        return RequestFacts()
    if path.endswith("/chat/completions"):
        text = _messages_text(obj.get("messages"), limit)
    elif path == "/generate":
        text = obj.get("text") if isinstance(obj.get("text"), str) else _prompt_text(obj.get("input_ids"))
        if isinstance(obj.get("text"), list):
            text = _prompt_text(obj.get("text"))
    else:
        text = _prompt_text(obj.get("prompt"))
    model = obj.get("model")
    user = obj.get("user")
    return RequestFacts(
        text=text[:limit],
        model=model if isinstance(model, str) else None,
        stream=obj.get("stream") is True,
        user=user if isinstance(user, str) else None,
    )
