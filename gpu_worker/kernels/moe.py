"""The experts of a MoE layer on the kernel path: ``fused_experts`` picks the launches.

- 1 to DECODE_MAX_TOKENS tokens: the decode path (``moe_decode.py``), two launches (gate_up
  with the activation, down with the routing weights) that read only the selected experts;
- more: alignment (``moe_align.py``, one or two launches) then the grouped GEMM
  (``moe_gemm.py``) for gate_up and for down;
- then the sum over each token's slots (``moe_norm.moe_sum``), unless the caller fuses it into
  its next kernel (``sum_slots=False``: the per-slot outputs [T*K, H] come back).

Every buffer's size is a function of the token count, the experts and the launch shapes alone,
and no launch reads anything back on the host: a forward of T tokens is capturable in a CUDA
graph and replays for any routing. Launch shapes come from ``moe_configs.json``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gpu_worker.kernels.activation import ACTS
from gpu_worker.kernels.moe_align import align_block
from gpu_worker.kernels.moe_configs import decode_config, gemm_config
from gpu_worker.kernels.moe_decode import DECODE_MAX_TOKENS, expert_gemv
from gpu_worker.kernels.moe_gemm import grouped_gemm
from gpu_worker.kernels.moe_norm import moe_sum


class ExpertScales(NamedTuple):
    """FP8 experts' scales: float32 [E, ceil(rows / rows_per_scale), 1 or ceil(K / 128)] for
    gate_up [E, 2I, H] and down [E, H, I] in e4m3 (``quant/fp8_math``'s layout, per expert)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    rows_per_scale: int = 1


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, act: str, sum_slots: bool = True,
                  scales: ExpertScales | None = None) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H], down [E, H, I], ids [T, K] int32, weights [T, K] float32 ->
    [T, H]: each token's weighted sum of its experts' gated MLPs (``models/moe.py``); or, without
    ``sum_slots``, each slot's weighted output [T*K, H] (slot k of token t at row t*K + k).
    With ``scales`` the experts are e4m3, dequantized tile by tile in the kernels' registers."""
    t, h = x.shape
    num_experts, i = gate_up.shape[0], down.shape[2]
    top_k = ids.shape[1]
    n = t * top_k
    x = x.contiguous()
    ids = ids.contiguous()
    flat_w = weights.reshape(-1)
    inter = torch.empty((n, i), dtype=x.dtype, device=x.device)
    pairs = torch.empty((n, h), dtype=x.dtype, device=x.device)
    if t == 0:
        return torch.empty_like(x) if sum_slots else pairs
    gs, ds = (scales.gate_up, scales.down) if scales is not None else (None, None)
    sr = scales.rows_per_scale if scales is not None else 1
    fp8 = scales is not None
    if t <= DECODE_MAX_TOKENS:
        expert_gemv(x, gate_up, inter, ids, decode_config(num_experts, h, i, top_k, "gate_up", fp8), act=ACTS[act],
                    w_scale=gs, scale_rows=sr)
        expert_gemv(inter, down, pairs, ids, decode_config(num_experts, h, i, top_k, "down", fp8),
                    topk_weights=flat_w, w_scale=ds, scale_rows=sr)
    else:
        cfg = gemm_config(num_experts, h, i, top_k, t, fp8)
        align = align_block(ids, num_experts, cfg["block_m"])
        grouped_gemm(x, gate_up, inter, align, n, top_k, cfg["gate_up"], act=ACTS[act], w_scale=gs, scale_rows=sr)
        grouped_gemm(inter, down, pairs, align, n, top_k, cfg["down"], topk_weights=flat_w, w_scale=ds,
                     scale_rows=sr)
    return moe_sum(pairs, top_k) if sum_slots else pairs
