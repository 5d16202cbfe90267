"""Grouped GEMM over the selected experts (``moe.py`` runs it past DECODE_MAX_TOKENS tokens).

The pairs arrive aligned (``moe_align.py``): block b of BLOCK_M rows belongs to expert
``block_expert[b]`` and its rows hold pairs (``sorted_ids``; ``n_pairs`` = padding). A program
owns one block and BLOCK_N output columns and streams that expert's weight rows once for all
the block's pairs. Two passes, one kernel:

- **gate_up** (``ACT`` >= 0): A row = the pair's token (``pair // TOP_K`` of x [T, H]); the
  program loads the gate rows n and the up rows I + n of W [E, 2I, H] and writes
  ``act(gate) * up`` (each rounded to the model dtype as HF does) at the pair's row of
  the intermediate [T*K, I];
- **down** (``ACT`` = -1, ``WEIGHTED``): A row = the pair's row of the intermediate; the output,
  rounded, times the pair's routing weight, rounded, goes to its row of [T*K, H], which
  ``moe_norm.moe_sum`` then sums over the slots.

Programs run in groups of GROUP_M blocks per column tile (blocks of one group reuse W tiles
from L2: consecutive blocks usually share an expert). The grid covers the most blocks the
alignment can use; programs past ``n_padded`` exit, so a CUDA graph replays one grid for its
token count; that count and the grid's size are runtime arguments the JIT does not specialise
on, so a step of a new size compiles nothing. It runs only in forwards of more than DECODE_MAX_TOKENS tokens, which launch
without PDL (``kernels/__init__.py``). ``IEEE``: float32 operands with exact products (fp32
models, the interpreter). FP8 experts (``WS`` > 0) as in ``moe_decode.py``: each weight tile
dequantized in registers (scale rows ``SR`` weight rows each, a runtime argument) and rounded to
the activations' dtype.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels import interpreting
from gpu_worker.kernels.moe_align import AlignBuffers

try:
    import triton
    import triton.language as tl

    from gpu_worker.kernels.activation import gated_value
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _mma(a, b, acc, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _deq(b, row_s, s_cols, k, km, nm, WS: tl.constexpr):
        """A [BLOCK_K, BLOCK_N] e4m3 weight tile -> its float32 value times its scales (WS 1:
        ``row_s`` [1, BLOCK_N], each weight row's one scale; WS 2: read from ``s_cols``, the scale
        row of each weight row; the caller rounds to its dtype)."""
        if WS == 1:
            return b.to(tl.float32) * row_s
        return b.to(tl.float32) * tl.load(s_cols + k[:, None] // 128, mask=km[:, None] & nm[None, :], other=0.0)

    @triton.jit(do_not_specialize=["n_pairs", "max_blocks", "SR"])
    def _moe_gemm_kernel(a_ptr, w_ptr, s_ptr, out_ptr, tw_ptr, sorted_ptr, block_expert_ptr, n_padded_ptr, N, K,
                         n_pairs, max_blocks, sa, sw_e, sw_n, ss_e, ss_r, so, SR, TOP_K: tl.constexpr,
                         ACT: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr, WS: tl.constexpr):
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        size_m = tl.minimum(max_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
        if pid_m * BLOCK_M >= tl.load(n_padded_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        pm = pair < n_pairs
        if ACT >= 0:
            a_rows = a_ptr + (pair // TOP_K).to(tl.int64)[:, None] * sa
        else:
            a_rows = a_ptr + pair.to(tl.int64)[:, None] * sa
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        w_cols = w_ptr + expert * sw_e + n.to(tl.int64)[None, :] * sw_n
        nc = tl.where(nm, n, 0)
        s_cols = s_ptr + expert * ss_e + (nc // SR).to(tl.int64)[None, :] * ss_r
        s_cols_u = s_ptr + expert * ss_e + ((N + nc) // SR).to(tl.int64)[None, :] * ss_r
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        row_s = tl.zeros([1, BLOCK_N], tl.float32)
        row_s_u = tl.zeros([1, BLOCK_N], tl.float32)
        if WS == 1:  # one scale a row: loaded once, not per K tile
            row_s = tl.load(s_cols, mask=nm[None, :], other=0.0)
            if ACT >= 0:
                row_s_u = tl.load(s_cols_u, mask=nm[None, :], other=0.0)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < K
            a = tl.load(a_rows + k[None, :], mask=pm[:, None] & km[None, :], other=0.0)
            b = tl.load(w_cols + k[:, None], mask=km[:, None] & nm[None, :], other=0.0)
            if WS > 0:
                b = _deq(b, row_s, s_cols, k, km, nm, WS).to(a.dtype)
            acc = _mma(a, b, acc, IEEE)
            if ACT >= 0:
                b = tl.load(w_cols + N * sw_n + k[:, None], mask=km[:, None] & nm[None, :], other=0.0)
                if WS > 0:
                    b = _deq(b, row_s_u, s_cols_u, k, km, nm, WS).to(a.dtype)
                acc_u = _mma(a, b, acc_u, IEEE)
        DT = out_ptr.dtype.element_ty
        if ACT >= 0:
            y = gated_value(acc.to(DT).to(tl.float32), acc_u.to(DT).to(tl.float32), ACT, DT)
        else:
            y = acc.to(DT).to(tl.float32)
            if WEIGHTED:
                y = y * tl.load(tw_ptr + pair, mask=pm, other=0.0)[:, None]
        tl.store(out_ptr + pair.to(tl.int64)[:, None] * so + n[None, :], y.to(DT), mask=pm[:, None] & nm[None, :])


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, align: AlignBuffers, n_pairs: int, top_k: int,
                 cfg: dict, act: int = -1, topk_weights: torch.Tensor | None = None,
                 w_scale: torch.Tensor | None = None, scale_rows: int = 1) -> torch.Tensor:
    """out[pair] = (gate_up pass, ``act`` >= 0) act(a[pair // top_k] @ gate_e^T) * (... @ up_e^T),
    or (down pass) (a[pair] @ W_e^T) * topk_weights[pair], e = the pair's expert; W [E, rows, K]
    (gate_up: rows = 2 * out.shape[1]). ``cfg``: block_n, block_k, group_m, num_warps, num_stages
    (``moe_configs.py``); BLOCK_M is the alignment's. FP8 experts: W e4m3 with ``w_scale``
    [E, ceil(rows / scale_rows), 1 or ceil(K / 128)]."""
    n, k = out.shape[1], w.shape[2]
    if act >= 0 and w.shape[1] != 2 * n:
        raise ValueError(f"gate_up weight rows {w.shape[1]} != 2 x intermediate {n}")
    grid = (align.max_blocks * triton.cdiv(n, cfg["block_n"]),)
    ws = 0 if w_scale is None else (1 if w_scale.shape[2] == 1 else 2)
    s = w_scale if w_scale is not None else w
    _moe_gemm_kernel[grid](
        a, w, s, out, topk_weights if topk_weights is not None else out, align.sorted_ids, align.block_expert,
        align.n_padded, n, k, n_pairs, align.max_blocks, a.stride(0), w.stride(0), w.stride(1),
        s.stride(0) if ws else 0, s.stride(1) if ws else 0, out.stride(0), scale_rows, TOP_K=top_k, ACT=act,
        WEIGHTED=topk_weights is not None, BLOCK_M=align.block_m, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
        GROUP_M=cfg["group_m"], IEEE=a.dtype == torch.float32 or interpreting(), WS=ws,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
