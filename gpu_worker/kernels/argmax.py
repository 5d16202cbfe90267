"""Greedy token selection: the index of each row's largest logit, first index on ties (as
``torch.argmax``), in two small kernels: every (row, chunk of the vocabulary) program finds
its chunk's maximum and first index, then one program per row picks the first chunk holding
the row's maximum. Spread over rows x chunks, one row of a 128k vocabulary uses 63 programs
where ``torch.argmax`` reduces it in a few programs (a latency-bound launch at one row).

NaN counts as +inf here (torch returns the first NaN's index): a NaN logit is a broken model
either way, and the token stays a valid id.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels import next_pow2, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 2048
_NO_INDEX = 2**31 - 1

if triton is not None:

    # The decode rows' logits are a view past the prefill rows': no alignment specialisation.
    @triton.jit(do_not_specialize_on_alignment=["x_ptr"])
    def _chunk_max_kernel(x_ptr, val_ptr, idx_ptr, V, sx, CHUNKS, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + r * sx + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        v = tl.where(v != v, float("inf"), v)
        mx = tl.max(v, axis=0)
        first = tl.min(tl.where(v == mx, offs, 2147483647), axis=0)
        tl.store(val_ptr + r * CHUNKS + c, mx)
        tl.store(idx_ptr + r * CHUNKS + c, first)

    # ``out`` may be a column of the draft's token buffer (8-byte aligned): no alignment variant.
    @triton.jit(do_not_specialize_on_alignment=["out_ptr"])
    def _row_pick_kernel(val_ptr, idx_ptr, out_ptr, CHUNKS, s_out, BLOCK_C: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK_C)
        m = c < CHUNKS
        v = tl.load(val_ptr + r * CHUNKS + c, mask=m, other=float("-inf"))
        i = tl.load(idx_ptr + r * CHUNKS + c, mask=m, other=2147483647)
        mx = tl.max(v, axis=0)
        tl.store(out_ptr + r * s_out, tl.min(tl.where(v == mx, i, 2147483647), axis=0).to(tl.int64))


def argmax_last(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``logits.argmax(-1)`` (int64, shape ``logits.shape[:-1]``) through the kernels where
    Triton runs the tensor (CUDA, or the CPU under the interpreter when asked), torch elsewhere.
    ``out``: a 1-D int64 tensor of the rows (any stride, e.g. a column of the draft tokens) to
    write instead of a new one; it is returned."""
    if not use_triton(logits) or logits.shape[-1] >= _NO_INDEX or logits.stride(-1) != 1 or (
            out is not None and out.dim() != 1):
        if out is None:
            return logits.argmax(-1)
        return out.copy_(logits.argmax(-1).view(out.shape))
    v = logits.shape[-1]
    x = logits.reshape(-1, v)
    rows = x.shape[0]
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=x.device)
        shape = logits.shape[:-1]
    else:
        assert out.shape[0] == rows and out.dtype == torch.int64, (out.shape, out.dtype, rows)
        shape = out.shape
    if rows and v:
        chunks = triton.cdiv(v, BLOCK)
        vals = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
        idx = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
        _chunk_max_kernel[(rows, chunks)](x, vals, idx, v, x.stride(0), chunks, BLOCK=BLOCK, num_warps=4)
        _row_pick_kernel[(rows,)](vals, idx, out, chunks, out.stride(0), BLOCK_C=next_pow2(chunks), num_warps=1)
    return out.view(shape)
