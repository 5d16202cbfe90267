"""The benchmark-width part of the sm_90 compile check (``python -m tests.helpers.hopper_compile
record-shapes``, ``make hopper-check SHAPES=1``): the engine's launches at the benchmark models'
widths, where the GPU's block sizes are chosen."""

from __future__ import annotations

import json
import sys

from tests.helpers.hopper_record import FP8, H200_SMS, cuda_launch_choices, recording


def record_shapes(root) -> set[str]:
    """Like ``record_engine``, at the benchmark models' widths (``benchmarks/configs``: the
    Llama-3.1-8B shape; the Gemma-4-shaped 9B with its assistant; each cut to two layers and an
    8k vocabulary, dummy weights, bf16): the block sizes the GPU compiles. About 12 minutes of
    interpreter on two cores."""
    import os
    import pathlib

    from tests.helpers.inproc import InProcEngine

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    import dummy_models

    dirs = dummy_models.make(str(root))
    for d in dirs.values():
        path = os.path.join(d, "config.json")
        cfg = json.load(open(path))
        text = cfg.get("text_config", cfg)
        text.update(vocab_size=8192, num_hidden_layers=2)
        if "layer_types" in text:
            text["layer_types"] = ["sliding_attention", "full_attention"]
        json.dump(cfg, open(path, "w"))
    os.environ["TANDEM_EMULATE_CUDA_GRAPHS"] = "1"
    with cuda_launch_choices(H200_SMS), recording() as seen:
        for model, draft, flags in (("llama-3.1-8b", None, {}), ("gemma4-dense-9b", "gemma4-dense-9b-assistant", {}),
                                    ("llama-3.1-8b", None, FP8)):
            eng = InProcEngine(dirs[model], draft=dirs[draft] if draft else None, attention_backend="triton",
                               dtype="bfloat16", load_format="dummy", max_total_tokens=4096, cuda_graph_bs=(1, 2),
                               **flags)
            eng.submit("a", list(range(5, 305)), max_new_tokens=3, ignore_eos=True)
            eng.run()
    return seen
