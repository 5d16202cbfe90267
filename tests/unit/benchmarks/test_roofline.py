"""benchmarks/roofline.py's step roofline of a measured decode phase: weight bytes once a step
plus each layer's KV over the rows' context, a sliding layer capped at its window a row (which
needs the row count); and model_shapes on a public config (8B: 16 GB of weights)."""

from __future__ import annotations

import pytest

from benchmarks.roofline import decode_phase_ceiling_tok_s, model_shapes, moe_shapes, moe_step_bytes

SHAPES = {"weight_bytes_read": 1000.0, "kv_layers": [(2.0, None), (1.0, 8)]}  # one full, one sliding (window 8)
W = {"decode_steps": 10, "decode_tokens_per_step": 2.0, "decode_ctx_tokens_per_step": 20.0}


def test_windowed_layers_need_rows_and_read_at_most_the_window():
    assert decode_phase_ceiling_tok_s(SHAPES, W, 1e3) is None
    # two rows of 10: the full layer reads 20 tokens, the sliding one 8 a row
    assert decode_phase_ceiling_tok_s(SHAPES, W, 1e3, rows=2) == pytest.approx(2.0 * 1e3 / (1000 + 2 * 20 + 1 * 16))
    # a context within the window: every key read
    short = dict(W, decode_ctx_tokens_per_step=6.0)
    assert decode_phase_ceiling_tok_s(SHAPES, short, 1e3, rows=1) == pytest.approx(2.0 * 1e3 / (1000 + 12 + 6))


def test_unwindowed_and_unmeasured():
    full = {"weight_bytes_read": 1000.0, "kv_layers": [(2.0, None)]}
    assert decode_phase_ceiling_tok_s(full, W, 1e3) == pytest.approx(2.0 * 1e3 / (1000 + 40))
    assert decode_phase_ceiling_tok_s(full, dict(W, decode_steps=0), 1e3) is None


def test_model_shapes_of_the_8b_config(tmp_path):
    import shutil

    shutil.copy("benchmarks/configs/llama-3.1-8b.json", tmp_path / "config.json")
    s = model_shapes(str(tmp_path))
    assert 7.9e9 < s["params"] < 8.1e9 and s["weight_bytes_read"] < s["all_weight_bytes"]
    assert len(s["kv_layers"]) == 32 and all(win is None for _, win in s["kv_layers"])


def test_moe_shapes_count_only_the_selected_experts(tmp_path):
    """Qwen3-30B-A3B: 48 MoE layers of 128 experts of 3 x 768 x 2048 weights; 3.3B parameters
    active at one token (its published figure) = fixed + 8 experts a layer."""
    import shutil

    shutil.copy("benchmarks/configs/qwen3-30b-a3b.json", tmp_path / "config.json")
    s = moe_shapes(str(tmp_path))
    assert s["num_experts"] == 128 and s["expert_bytes"] == [3 * 768 * 2048 * 2] * 48
    one_token = moe_step_bytes(s, [8.0] * 48, ctx_tokens=0, rows=1)
    embed = 151936 * 2048  # the untied input table: not read whole, but counted in the published 3.3B
    assert one_token["kv"] == 0 and 3.2e9 < one_token["total"] / 2 + embed < 3.4e9
    every = moe_step_bytes(s, [128.0] * 48, ctx_tokens=0, rows=1)
    assert every["total"] == pytest.approx(s["weight_bytes_read"])


def test_fp8_weights_and_kv_halve_the_bytes(tmp_path):
    """FP8 projections count a byte an element plus a float32 scale a row; the embedding and head
    stay bf16; an FP8 KV cache a byte an element."""
    import shutil

    shutil.copy("benchmarks/configs/llama-3.1-8b.json", tmp_path / "config.json")
    bf16 = model_shapes(str(tmp_path))
    fp8 = model_shapes(str(tmp_path), quantization="fp8", kv_dtype_bytes=1)
    head = 128256 * 4096 * 2  # lm_head, bf16 (the input embedding is not read whole)
    assert fp8["weight_bytes_read"] == pytest.approx((bf16["weight_bytes_read"] - head) / 2 + head, rel=1e-3)
    assert all(a == 2 * b for (a, _), (b, _) in zip(bf16["kv_layers"], fp8["kv_layers"]))
