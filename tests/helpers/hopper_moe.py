"""The MoE part of the sm_90 compile check (``hopper_record.record_engine`` calls it): launches of
the MoE kernels at every launch shape ``gpu_worker/kernels/moe_configs.json`` holds, and the FP8
experts' variants at the default shapes."""

from __future__ import annotations

import torch


def record_moe_configs() -> None:
    """Launch the MoE expert kernels with every launch shape ``moe_configs.json`` holds (each
    model shape's decode passes at 1-4 tokens, every grouped bucket, the alignment's one- and
    two-launch forms) on tiny operands, with each model shape's own K in bf16 and the default
    also in fp32: a variant's build depends on its block sizes, K and dtypes, not on the widths,
    so the engine runs above need not reach every bucket for all of them to be compiled."""
    import json

    from gpu_worker.kernels import moe_configs
    from gpu_worker.kernels.moe import fused_experts
    from gpu_worker.kernels.moe_align import PLACE_IN_COUNT, align_block
    from gpu_worker.kernels.moe_decode import DECODE_MAX_TOKENS, expert_gemv
    from gpu_worker.kernels.moe_gemm import grouped_gemm

    entries = json.load(open(moe_configs.PATH))["shapes"]
    e, h, i = 8, 32, 16
    for key, entry in entries.items():
        # a model shape's own K, in bf16; the default also in fp32 (the exact-dot variants)
        k = int(key.rsplit("K=", 1)[1]) if "K=" in key else 2
        for dtype in (torch.bfloat16,) if "K=" in key else (torch.bfloat16, torch.float32):
            gate_up, down = torch.randn(e, 2 * i, h).to(dtype), torch.randn(e, h, i).to(dtype)
            for t in range(1, DECODE_MAX_TOKENS + 1):
                ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).int()
                inter = torch.empty(t * k, i, dtype=dtype)
                expert_gemv(torch.randn(t, h).to(dtype), gate_up, inter, ids, entry["decode"]["gate_up"], act=0)
                expert_gemv(inter, down, torch.empty(t * k, h, dtype=dtype), ids, entry["decode"]["down"],
                            topk_weights=torch.rand(t * k))
            ids = torch.stack([torch.randperm(e)[:k] for _ in range(5)]).int()
            for bucket in entry["gemm"]:
                align = align_block(ids, e, bucket["block_m"])
                inter = torch.empty(5 * k, i, dtype=dtype)
                grouped_gemm(torch.randn(5, h).to(dtype), gate_up, inter, align, 5 * k, k, bucket["gate_up"], act=0)
                grouped_gemm(inter, down, torch.empty(5 * k, h, dtype=dtype), align, 5 * k, k, bucket["down"],
                             topk_weights=torch.rand(5 * k))
    record_fp8_experts(entries, e, h, i)
    from gpu_worker.kernels.moe_norm import gemma_moe_combine, moe_sum

    rows = torch.randn(3, h).bfloat16()  # at 3 tokens (PDL on): the separate sum and Gemma 4's combine
    gemma_moe_combine(rows, rows, torch.ones(h).bfloat16(), torch.ones(h).bfloat16(), 1e-6)  # (PLE, TP > 1)
    moe_sum(torch.randn(3 * 2, h).bfloat16(), 2)
    many = PLACE_IN_COUNT // 2 + 1  # tokens of two slots past one program's placing
    fused_experts(torch.randn(many, h).bfloat16(), torch.randn(e, 2 * i, h).bfloat16(), torch.randn(e, h, i).bfloat16(),
                  torch.randint(0, e, (many, 2)).int(), torch.rand(many, 2), "gelu_pytorch_tanh")


def record_fp8_experts(entries: dict, e: int, h: int, i: int) -> None:
    """FP8 experts, with one scale a row and with a scale per row and 128 columns, in bf16:
    through the default launch shapes (the decode passes and every grouped bucket, one token
    count each), and through every model shape's own FP8 decode shapes (``decode_fp8``) at 1-4
    tokens."""
    from gpu_worker.kernels.moe import ExpertScales, fused_experts
    from gpu_worker.kernels.moe_decode import DECODE_MAX_TOKENS, expert_gemv
    from gpu_worker.quant.fp8_math import FP8

    gate_up, down = torch.randn(e, 2 * i, h).to(FP8), torch.randn(e, h, i).to(FP8)
    tokens = [1] + [b["max_tokens"] + 1 for b in entries["default"]["gemm"][:-1]] + [5]
    for kb in (1, 2):
        scales = ExpertScales(torch.rand(e, 2 * i, kb), torch.rand(e, h, kb), 1)
        for t in tokens:
            ids = torch.randint(0, e, (t, 2)).int()
            fused_experts(torch.randn(t, h).bfloat16(), gate_up, down, ids, torch.rand(t, 2), "silu", scales=scales)
        for key, entry in entries.items():
            if "decode_fp8" not in entry:
                continue
            k = int(key.rsplit("K=", 1)[1])
            cfg = entry["decode_fp8"]
            for t in range(1, DECODE_MAX_TOKENS + 1):
                ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).int()
                inter = torch.empty(t * k, i, dtype=torch.bfloat16)
                expert_gemv(torch.randn(t, h).bfloat16(), gate_up, inter, ids, cfg["gate_up"], act=0,
                            w_scale=scales.gate_up)
                expert_gemv(inter, down, torch.empty(t * k, h, dtype=torch.bfloat16), ids, cfg["down"],
                            topk_weights=torch.rand(t * k), w_scale=scales.down)
