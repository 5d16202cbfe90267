"""Hugging Face Hub ids as checkpoint paths: ``resolve_model_paths(args)`` returns the args with
every checkpoint path local (the model, the tokenizer, the draft), downloading what is missing.

A path that is a local directory wins and is never looked up. Anything else that reads as a
Hub id (``name`` or ``org/name``) goes through ``huggingface_hub``'s cache: ``--revision``,
``--download-dir`` (else ``$HF_HOME/hub``), ``HF_TOKEN`` and ``HF_HUB_OFFLINE`` mean what they
mean there, and a checkpoint already cached is served without the network. Only the files the
engine reads are fetched (config and generation config, tokenizer files, chat template, the
safetensors shards its index names, else every top-level ``*.safetensors``), with the Hub's
progress bars. A failure is one ``ArgError`` line naming the flag, the id, why, and how to
point at a local directory. ``tandem serve`` and ``tandem.LLM`` both call this.
"""

from __future__ import annotations

import json
import os
import re

from common.args import ServerArgs
from common.flags import ArgError

# The small files the front and the worker read (common.hf_files, tokenizer_proc, gpu_worker).
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                    "model.safetensors.index.json")
_REPO_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")
_PATH_FIELDS = (("model_path", "--model-path"), ("tokenizer_path", "--tokenizer-path"),
                ("speculative_draft_model_path", "--speculative-draft-model-path"))


def looks_like_hub_id(path: str) -> bool:
    """``name`` or ``org/name``, and no path that could only be local (``/x``, ``./x``, ``~/x``)."""
    return bool(_REPO_ID.match(path)) and not path.startswith((".", "~")) and ".." not in path


def resolve_model_paths(args: ServerArgs) -> ServerArgs:
    """``args`` with each checkpoint path that names a Hub id replaced by its local snapshot.
    The model keeps its id as the served name unless ``--served-model-name`` gave one."""
    changes: dict[str, str] = {}
    for name, flag in _PATH_FIELDS:
        value = getattr(args, name)
        if value is None or os.path.isdir(value) or not looks_like_hub_id(value):
            continue  # local, or not an id: validation says what is wrong with it
        changes[name] = download_checkpoint(value, flag, args.revision, args.download_dir)
    if "model_path" in changes and args.served_model_name is None:
        changes["served_model_name"] = args.model_path
    return args.replace(**changes) if changes else args


def download_checkpoint(repo_id: str, flag: str, revision: str | None, cache_dir: str | None) -> str:
    """The local snapshot directory of ``repo_id`` with the files the engine reads."""
    import huggingface_hub  # noqa: PLC0415 - only when a Hub id is given

    def fetch(patterns: list[str]) -> str:
        return huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                                 allow_patterns=patterns)

    try:
        local = fetch(list(CHECKPOINT_FILES))
        index = os.path.join(local, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        else:
            shards = ["*.safetensors"]
        return fetch(shards)
    except Exception as exc:  # noqa: BLE001 - every failure becomes the one line below
        raise ArgError(f"{flag}: {repo_id!r} is not a local directory and the Hugging Face Hub could not provide "
                       f"it: {_why(exc, revision, cache_dir)}. To serve a local checkpoint, pass its directory "
                       f"({flag} /path/to/checkpoint)") from None


def _why(exc: Exception, revision: str | None, cache_dir: str | None) -> str:
    from huggingface_hub import constants, errors  # noqa: PLC0415

    cache = cache_dir or constants.HF_HUB_CACHE
    if isinstance(exc, errors.GatedRepoError):
        return "the model is gated (accept its terms on the Hub, then set HF_TOKEN)"
    if isinstance(exc, errors.RepositoryNotFoundError):
        return "no such model on the Hub (if it is private, set HF_TOKEN)"
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"it has no revision {revision!r}"
    if constants.HF_HUB_OFFLINE:
        return f"HF_HUB_OFFLINE is set and it is not in the cache {cache}"
    if isinstance(exc, (errors.LocalEntryNotFoundError, errors.IncompleteSnapshotError, errors.OfflineModeIsEnabled)):
        return f"the Hub cannot be reached and it is not in the cache {cache}"
    if isinstance(exc, errors.HfHubHTTPError):
        return str(exc).splitlines()[0]
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}"
