"""Kernels Triton's interpreter would run but an H200 would not, so the sm_90 compile check
(tests/helpers/hopper_compile.py) is seen to fail where it should: one block's operands need more
shared memory than sm_90 has; one inline PTX instruction does not exist (``ptxas`` rejects it),
once unconditionally and once only in the PDL-on build that a CPU launch never takes."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _smem_hog_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    a = tl.load(a_ptr + i[:, None] * N + i[None, :])
    b = tl.load(b_ptr + i[:, None] * N + i[None, :])
    tl.store(c_ptr + i[:, None] * N + i[None, :], tl.dot(a, b))


@triton.jit
def _bad_ptx_kernel(x_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    y = tl.inline_asm_elementwise("no.such.instruction.b32 $0, $1;", "=r,r", [tl.load(x_ptr + i)],
                                  dtype=tl.int32, is_pure=True, pack=1)
    tl.store(x_ptr + i, y)


@triton.jit
def _bad_when_pdl_kernel(x_ptr, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """Fine as the CPU launches it (PDL off); broken only in the PDL-on build the GPU makes."""
    i = tl.arange(0, BLOCK)
    y = tl.load(x_ptr + i)
    if PDL == 2:
        y = tl.inline_asm_elementwise("no.such.instruction.b32 $0, $1;", "=r,r", [y], dtype=tl.int32,
                                      is_pure=True, pack=1)
    tl.store(x_ptr + i, y)
