"""The ids that end a request (unless it sets ``ignore_eos``): the checkpoint's EOS ids and the
tokenizer's.

``generation_config.json`` and ``config.json`` (and its ``text_config``) list the model's end
ids; the tokenizer's own EOS token (``tokenizer_config.json`` / ``special_tokens_map.json``)
stops a request too, as in vLLM and SGLang, which always stop on it: a fine-tuned checkpoint
whose chat template ends turns with a token the configs do not list would otherwise run to
``max_tokens``. The worker reports the set in ``WorkerReady``; the scheduler's finish rules and
the worker's ``min_tokens`` mask both use it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from common.hf_files import read_json, special_token


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def tokenizer_eos_id(tokenizer_dir: str | Path) -> int | None:
    """The tokenizer's EOS token id, or None (no tokenizer.json, no EOS token, or one the
    vocabulary does not hold)."""
    tokenizer_dir = Path(tokenizer_dir)
    path = tokenizer_dir / "tokenizer.json"
    text = special_token(read_json(tokenizer_dir / "tokenizer_config.json"),
                         read_json(tokenizer_dir / "special_tokens_map.json"), "eos_token")
    if text is None or not path.is_file():
        return None
    from tokenizers import Tokenizer  # the worker's only use of it: once, at start-up

    return Tokenizer.from_file(os.fspath(path)).token_to_id(text)


def read_eos_token_ids(model_dir: str | Path, tokenizer_dir: str | Path | None = None) -> tuple[int, ...]:
    """EOS ids from generation_config.json, then config.json (and its text_config), then the
    tokenizer's EOS (``tokenizer_dir``, default ``model_dir``), deduplicated in that order."""
    model_dir = Path(model_dir)
    ids = _as_ids(read_json(model_dir / "generation_config.json").get("eos_token_id"))
    cfg = read_json(model_dir / "config.json")
    ids += _as_ids(cfg.get("eos_token_id"))
    if isinstance(cfg.get("text_config"), dict):
        ids += _as_ids(cfg["text_config"].get("eos_token_id"))
    tok = tokenizer_eos_id(tokenizer_dir if tokenizer_dir is not None else model_dir)
    ids += [] if tok is None else [tok]
    return tuple(dict.fromkeys(ids))
