"""A Hugging Face Hub cache laid out as ``huggingface_hub`` writes it, filled from local
checkpoints, so Hub ids resolve with ``HF_HUB_OFFLINE=1`` and no network."""

from __future__ import annotations

import hashlib
import os
import shutil


def add_to_cache(hf_home: str, repo_id: str, src_dir: str, revision: str = "main") -> str:
    """Copy ``src_dir``'s files into ``$HF_HOME/hub`` as snapshot ``revision`` of ``repo_id``;
    returns the snapshot directory."""
    repo = os.path.join(hf_home, "hub", "models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snapshot = os.path.join(repo, "snapshots", commit)
    shutil.copytree(src_dir, snapshot, dirs_exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", revision), "w") as f:
        f.write(commit)
    return snapshot
