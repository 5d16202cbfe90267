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

import torch

from gpu_worker.kernels.activation import ACTS
from gpu_worker.kernels.moe_align import align_block
from gpu_worker.kernels.moe_configs import decode_config, gemm_config
from gpu_worker.kernels.moe_decode import DECODE_MAX_TOKENS, expert_gemv
from gpu_worker.kernels.moe_gemm import grouped_gemm
from gpu_worker.kernels.moe_norm import moe_sum


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, act: str, sum_slots: bool = True) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H], down [E, H, I], ids [T, K] int32, weights [T, K] float32 ->
    [T, H]: each token's weighted sum of its experts' gated MLPs (``models/moe.py``); or, without
    ``sum_slots``, each slot's weighted output [T*K, H] (slot k of token t at row t*K + k)."""
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
    if t <= DECODE_MAX_TOKENS:
        expert_gemv(x, gate_up, inter, ids, decode_config(num_experts, h, i, top_k, "gate_up"), act=ACTS[act])
        expert_gemv(inter, down, pairs, ids, decode_config(num_experts, h, i, top_k, "down"), topk_weights=flat_w)
    else:
        cfg = gemm_config(num_experts, h, i, top_k, t)
        align = align_block(ids, num_experts, cfg["block_m"])
        grouped_gemm(x, gate_up, inter, align, n, top_k, cfg["gate_up"], act=ACTS[act])
        grouped_gemm(inter, down, pairs, align, n, top_k, cfg["down"], topk_weights=flat_w)
    return moe_sum(pairs, top_k) if sum_slots else pairs
