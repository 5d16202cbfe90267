"""Model directories for ``--load-format dummy`` benchmarks, from the configs in
``benchmarks/configs`` (public shapes: Llama-3.1-8B, Qwen3-0.6B; a dense Gemma-4-shaped 9B
target with a 4-layer frozen-KV assistant). A directory holds config.json plus the bundled
tokenizer (benchmarks feed random token ids; the tokenizer only satisfies start-up checks).

    python benchmarks/dummy_models.py OUT_DIR   # -> OUT_DIR/<name>/ for every config
"""

from __future__ import annotations

import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(HERE, "configs")
TOKENIZER = os.path.join(os.path.dirname(HERE), "models", "tiny-shakespeare", "target")


def make(out_root: str) -> dict[str, str]:
    dirs = {}
    for fname in sorted(os.listdir(CONFIGS)):
        name = fname.removesuffix(".json")
        d = os.path.join(out_root, name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(CONFIGS, fname)) as f:
            cfg = json.load(f)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        for tok in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(TOKENIZER, tok), d)
        dirs[name] = d
    return dirs


if __name__ == "__main__":
    for name, d in make(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tandem-dummy").items():
        print(name, d)
