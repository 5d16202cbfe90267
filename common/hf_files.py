"""Reading a HF checkpoint's small JSON files, shared by the front (tokenizer facts) and the
worker (end ids): one rule for where a special token's string lives."""

from __future__ import annotations

import json
import os
from typing import Any


def read_json(path: str | os.PathLike) -> dict:
    """The file's top-level object; {} when it is missing or not an object."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def token_content(value: Any) -> str | None:
    """Special tokens are stored either as plain strings or as serialised AddedToken dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_token(tokenizer_config: dict, special_map: dict, key: str) -> str | None:
    """``key``'s token string (e.g. "eos_token"): tokenizer_config.json first, then
    special_tokens_map.json."""
    return token_content(tokenizer_config.get(key)) or token_content(special_map.get(key))
