"""benchmarks/moe_bench.py's measured expert union on a tiny MoE model (CPU): the routing of
every decode row of every MoE layer, and the mean distinct experts over B rows it gives, which
the step roofline counts (at one row exactly top-k; never more than the experts or B x top-k)."""

from __future__ import annotations

import numpy as np

from benchmarks.moe_bench import measure_union, report_rows, union_curve
from benchmarks.roofline import moe_shapes
from tests.helpers.checkpoints import build_qwen3_moe


def test_union_of_the_experts_a_decode_step_selects(tmp_path):
    d = build_qwen3_moe(str(tmp_path / "q"))  # 3 layers, 2 of them MoE: 8 experts, top-2
    out = tmp_path / "ids.npy"
    measure_union(d, rows=4, steps=3, out=str(out), device="cpu", prompt_len=16)
    ids = np.load(out)
    assert ids.shape == (2, 3, 4, 2) and ids.min() >= 0 and ids.max() < 8
    assert union_curve(ids, 1) == [2.0, 2.0]
    for b in (2, 4, 9):
        assert all(2.0 <= u <= min(8, 2 * b) for u in union_curve(ids, b))
    shapes = moe_shapes(d)
    run = {"workloads": [{"num_prompts": 4, "decode_steps": 3, "decode_tokens_per_step": 4.0,
                          "decode_ctx_tokens_per_step": 80.0, "decode_tok_s": 100.0, "decode_busy_ms_per_step": 40.0,
                          "gpu_idle_frac": 0.0, "output_tok_s": 90.0}]}
    row = report_rows("tiny", shapes, ids, run, bw=1e9)[0]
    assert shapes["expert_bytes"] == [3 * 24 * 64 * 2] * 2  # gate, up, down: 24 x 64 each, 2 bytes
    fp8 = moe_shapes(d, quantization="fp8")  # e4m3 and a float32 scale per output channel
    assert fp8["expert_bytes"] == [3 * 24 * 64 + 4 * (2 * 24 + 64)] * 2
    assert fp8["fixed_bytes"] < shapes["fixed_bytes"]  # attention and the dense layer's MLP in FP8 too
    assert row["bytes"]["experts"] == sum(u * b for u, b in zip(union_curve(ids, 4), shapes["expert_bytes"]))
    assert 0 < row["of_roofline"] < 1e3
