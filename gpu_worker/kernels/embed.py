"""The frozen-KV draft's input row in one launch: ``cat(table[ids] * scale, tail)``; with no tail,
a scaled embedding (``embed_scaled``).

Each of the S draft steps feeds the assistant's pre-projection ``[R, 2H]``: the target's scaled
embedding of the token just drafted, then the previous hidden. In torch that is a gather, a
multiply and a cat, three launches at one row on the draft loop's critical path.

Bitwise torch's result: a bf16 / fp16 tensor times a Python float is computed in float32 and
rounded once to the tensor's dtype; the tail is copied as is. Both halves are rounded to the
output's dtype (the tail's, which the caller makes the table's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_worker.kernels import PDL_ON, next_pow2, pdl, use_triton
from gpu_worker.kernels.gdc import gdc_enter

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path below
    triton = None

MAX_BLOCK = 2048

if triton is not None:

    # ids may be a column of the draft's token buffer or a view into a staged batch: no
    # alignment specialisation on it (one compiled variant, none built mid-serving).
    @triton.jit(do_not_specialize_on_alignment=["ids_ptr"])
    def _embed_cat_kernel(ids_ptr, tab_ptr, tail_ptr, out_ptr, H, HT, s_ids, s_tab, s_tail, s_out, scale,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Program (r, 0) writes row r's scaled embedding, (r, 1) copies its tail after it."""
        gdc_enter(PDL)
        r = tl.program_id(0).to(tl.int64)
        dst = out_ptr + r * s_out
        cols = tl.arange(0, BLOCK)
        if tl.program_id(1) == 0:
            src = tab_ptr + tl.load(ids_ptr + r * s_ids).to(tl.int64) * s_tab
            for c0 in range(0, H, BLOCK):
                c = c0 + cols
                e = tl.load(src + c, mask=c < H, other=0.0).to(tl.float32)
                tl.store(dst + c, (e * scale).to(out_ptr.dtype.element_ty), mask=c < H)
        else:
            for c0 in range(0, HT, BLOCK):
                c = c0 + cols
                v = tl.load(tail_ptr + r * s_tail + c, mask=c < HT, other=0.0)
                tl.store(dst + H + c, v.to(out_ptr.dtype.element_ty), mask=c < HT)


def embed_cat(ids: torch.Tensor, table: torch.Tensor, scale: float, tail: torch.Tensor) -> torch.Tensor:
    """ids [R] (int), table [V, H], tail [R, Ht] -> [R, H + Ht] in the table's dtype:
    ``cat(table[ids] * scale, tail)``. The kernel where Triton runs the tensors (the torch ops
    elsewhere); a PDL level as the norm kernels (one-row forwards)."""
    assert ids.dim() == 1 and tail.dim() == 2 and tail.shape[0] == ids.shape[0], (ids.shape, tail.shape)
    if not use_triton(tail) or table.stride(1) != 1 or tail.stride(1) != 1 or tail.dtype != table.dtype:
        return torch.cat([F.embedding(ids, table) * scale, tail.to(table.dtype)], dim=-1)
    r, h, ht = ids.shape[0], table.shape[1], tail.shape[1]
    out = torch.empty((r, h + ht), dtype=table.dtype, device=tail.device)
    if r:
        on = pdl(tail)
        _embed_cat_kernel[(r, 2)](ids, table, tail, out, h, ht, ids.stride(0), table.stride(0), tail.stride(0),
                                  out.stride(0),
                                  float(scale), BLOCK=min(MAX_BLOCK, next_pow2(max(h, ht))), PDL=on,
                                  num_warps=4, launch_pdl=on == PDL_ON)
    return out


def embed_scaled(ids: torch.Tensor, table: torch.Tensor, scale: float) -> torch.Tensor:
    """ids [R] -> ``table[ids] * scale`` [R, H] in the table's dtype, one launch (the Gemma target's
    input embedding: torch's gather and multiply are two launches). The kernel where Triton runs
    the tensors, torch's ops elsewhere."""
    assert ids.dim() == 1, ids.shape
    if not use_triton(table) or table.stride(1) != 1:
        return F.embedding(ids, table) * scale
    r, h = ids.shape[0], table.shape[1]
    out = torch.empty((r, h), dtype=table.dtype, device=table.device)
    if r:
        on = pdl(out)
        _embed_cat_kernel[(r, 1)](ids, table, table, out, h, 0, ids.stride(0), table.stride(0), 0, out.stride(0),
                                  float(scale), BLOCK=min(MAX_BLOCK, next_pow2(h)), PDL=on, num_warps=4,
                                  launch_pdl=on == PDL_ON)
    return out
