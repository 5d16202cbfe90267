"""The MoE decode path: 1 to DECODE_MAX_TOKENS tokens (decode at small batches, MTP's verify
and draft at one request), GEMV-style, reading only the selected experts' weights once each.

No alignment: the grid is (pair, column tile) over the T*K pairs, and the program of pair p
serves p's expert only if p is that expert's first pair (lowest number); it finds the expert's
other pairs (at most one per token) itself from the ids [T, K], so each selected expert's rows
are streamed by exactly one program per tile and used for all its tokens (x padded to MP = 16
rows, one ``tl.dot`` per weight tile, as the tensor-core GEMV in ``gemv_kernels.py``). The other
programs exit at once. Passes as in ``moe_gemm.py``:

- **gate_up** (``ACT`` >= 0): a tile is BLOCK_N / 2 gate rows and the matching up rows of
  W [E, 2I, H]; writes ``act(gate) * up`` at each of the expert's pairs' rows of [T*K, I];
- **down** (``ACT`` = -1): reads the pairs' intermediate rows; writes the rounded output times
  the pair's routing weight, rounded, at its row of [T*K, H].

Weight bytes read = the union of the experts the step's tokens selected; the grid depends only
on T (capturable, no host sync), and T is a runtime argument: one compiled variant serves 1-4
tokens.

FP8 experts (``WS`` > 0: W e4m3 with float32 scales [E, ceil(rows / SR), KB], ``fp8_math``'s
layout per expert; ``SR`` a runtime argument): a weight tile reaches the tensor cores converted
to x's dtype, which holds every e4m3 value exactly, and the scales multiply the float32 sums:
a row's scale once at the end (``WS`` 1), a 128-column block's each K tile's partial sum
(``WS`` 2, K tiles of at most 128 columns). So the products are the exact ones of the e4m3
values and x, from half the bytes, with no multiply per weight.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels import PDL_ON, interpreting, next_pow2, pdl
from gpu_worker.kernels.gdc import gdc_enter

try:
    import triton
    import triton.language as tl

    from gpu_worker.kernels.activation import gated_value
except ImportError:
    triton = None

DECODE_MAX_TOKENS = 4
MP = 16  # x rows padded to tl.dot's smallest tile

if triton is not None:

    @triton.jit
    def _dot(w, xt, acc, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(w, xt, acc)

    @triton.jit(do_not_specialize=["T", "SR"])
    def _moe_gemv_kernel(a_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, tw_ptr, N, K, sa, sw_e, sw_n, ss_e, ss_r, so, T, SR,
                         TOP_K: tl.constexpr, BLOCK_TK: tl.constexpr, ACT: tl.constexpr, MP: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                         WS: tl.constexpr):
        gdc_enter(PDL)
        p = tl.program_id(0)
        expert = tl.load(ids_ptr + p)
        r = tl.arange(0, MP)
        s = tl.arange(0, BLOCK_TK)
        flat = r[:, None] * TOP_K + s[None, :]
        ids = tl.load(ids_ptr + flat, mask=(r < T)[:, None] & (s < TOP_K)[None, :], other=-1)
        match = ids == expert
        if tl.min(tl.where(match, flat, MP * BLOCK_TK)) != p:
            return  # an earlier pair's program serves this expert
        pair = tl.sum(tl.where(match, flat, 0), axis=1)  # [MP]: token r's pair with this expert
        has = tl.sum(match.to(tl.int32), axis=1) > 0
        if ACT >= 0:
            a_cols = a_ptr + r.to(tl.int64)[None, :] * sa  # gate_up reads the tokens' rows
            HALF: tl.constexpr = BLOCK_N // 2
            i = tl.arange(0, BLOCK_N)
            j = tl.program_id(1) * HALF + i % HALF
            w_row = j + (i // HALF) * N
            wm = j < N
        else:
            a_cols = a_ptr + pair.to(tl.int64)[None, :] * sa  # down reads the pairs' rows
            w_row = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            wm = w_row < N
        w_rows = w_ptr + expert.to(tl.int64) * sw_e + w_row.to(tl.int64)[:, None] * sw_n
        s_rows = s_ptr + expert.to(tl.int64) * ss_e + (tl.where(wm, w_row, 0) // SR).to(tl.int64)[:, None] * ss_r
        acc = tl.zeros([BLOCK_N, MP], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < K
            w = tl.load(w_rows + k[None, :], mask=wm[:, None] & km[None, :], other=0.0)
            xt = tl.load(a_cols + k[:, None], mask=km[:, None] & has[None, :], other=0.0)
            if WS > 0:
                w = w.to(xt.dtype)  # exact: e4m3 values are bf16 / float32 values
            if WS == 2:  # the tile lies in one 128-column block: its partial sum times the block's scale
                sc = tl.load(s_rows + k0 // 128, mask=wm[:, None], other=0.0)
                acc += _dot(w, xt, tl.zeros([BLOCK_N, MP], tl.float32), IEEE) * sc
            else:
                acc = _dot(w, xt, acc, IEEE)
        if WS == 1:  # one scale a row: on the sum
            acc = acc * tl.load(s_rows, mask=wm[:, None], other=0.0)
        DT = out_ptr.dtype.element_ty
        if ACT >= 0:
            g, u = tl.split(tl.permute(tl.reshape(acc, [2, HALF, MP]), [1, 2, 0]))
            y = gated_value(g.to(DT).to(tl.float32), u.to(DT).to(tl.float32), ACT, DT)
            n = tl.program_id(1) * HALF + tl.arange(0, HALF)
        else:
            y = acc.to(DT).to(tl.float32) * tl.load(tw_ptr + pair, mask=has, other=0.0)[None, :]
            n = w_row
        tl.store(out_ptr + pair.to(tl.int64)[None, :] * so + n[:, None], y.to(DT),
                 mask=has[None, :] & (n < N)[:, None])


def expert_gemv(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, cfg: dict, act: int = -1,
                topk_weights: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                scale_rows: int = 1) -> torch.Tensor:
    """The decode pass over T = ids.shape[0] <= DECODE_MAX_TOKENS tokens (module docstring):
    gate_up (``act`` >= 0, a = x [T, H]) or down (a = intermediate [T*K, I], ``topk_weights``
    [T*K] float32). ``cfg``: block_n, block_k, num_warps, num_stages (``moe_configs.py``).
    FP8 experts: w e4m3 with ``w_scale`` [E, ceil(rows / scale_rows), 1 or ceil(K / 128)]."""
    t, top_k = ids.shape
    if t > DECODE_MAX_TOKENS:
        raise ValueError(f"the MoE decode path takes at most {DECODE_MAX_TOKENS} tokens, got {t}")
    n, k = out.shape[1], w.shape[2]
    tiles = triton.cdiv(n, cfg["block_n"] // 2 if act >= 0 else cfg["block_n"])  # a gated tile: BLOCK_N / 2 outputs
    on = pdl(ids)  # by the token count (the down pass reads T*K rows)
    ws = 0 if w_scale is None else (1 if w_scale.shape[2] == 1 else 2)
    s = w_scale if w_scale is not None else w
    block_k = min(cfg["block_k"], 128) if ws == 2 else cfg["block_k"]  # a K tile within one scale block
    _moe_gemv_kernel[(t * top_k, tiles)](
        a, w, s, out, ids, topk_weights if topk_weights is not None else out, n, k, a.stride(0), w.stride(0),
        w.stride(1), s.stride(0) if ws else 0, s.stride(1) if ws else 0, out.stride(0), T=t, SR=scale_rows,
        TOP_K=top_k, BLOCK_TK=next_pow2(top_k), ACT=act, MP=MP, BLOCK_N=cfg["block_n"], BLOCK_K=block_k,
        IEEE=a.dtype == torch.float32 or interpreting(), PDL=on, WS=ws,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=on == PDL_ON,
    )
    return out
