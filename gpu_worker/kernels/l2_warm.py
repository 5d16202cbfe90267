"""Read a weight's leading bytes into L2 (``warm_l2``), for a projection about to run.

At one decode row, HBM idles while the small kernels between two projections run (norms,
RoPE + KV store, decode attention, the activation: ~19 us of a Llama-8B layer's ~145). Run
beside them, on a side stream of the graph (``gpu_worker/weight_prefetch.py``), this kernel
streams the next projection's weights into L2, so that projection reads part of them at L2
speed instead of HBM's.

Each program covers one contiguous chunk of 32-bit words, in one of two ways: L2-only loads
(``.cg``), whose XOR it stores to ``out[pid]`` — a value nothing reads, which keeps the loads
from being compiled away and gives the tests a torch reference; or (``evict_last``) one
``prefetch.global.L2::evict_last`` per 32-byte sector, which marks the lines for eviction after
the streams of other weights and returns nothing (``out[pid]`` = 0; CUDA only). Triton's own
``eviction_policy`` cannot be combined with ``.cg`` (ptxas rejects it, H200 2026-12-03).
"""

from __future__ import annotations

import torch

from gpu_worker.kernels import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: nothing calls warm_l2 there
    triton = None

BLOCK = 2048  # words (8 KB) per program per iteration
ALIGN = 16  # bytes: a weight whose start is not 16-byte aligned is not warmed

if triton is not None:

    @triton.jit
    def _warm_kernel(src_ptr, out_ptr, n_words, CHUNK, BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr):
        pid = tl.program_id(0)
        lo = pid.to(tl.int64) * CHUNK
        hi = tl.minimum(n_words, lo + CHUNK)
        acc = tl.zeros([BLOCK], tl.int32)
        for start in range(lo, hi, BLOCK):
            if EVICT_LAST:  # one prefetch per 32-byte sector, marked evict-last in L2; no value
                sec = tl.minimum(start + tl.arange(0, BLOCK // 8) * 8, hi - 1)
                tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; // $0", "=r,l", [src_ptr + sec],
                                          dtype=tl.int32, is_pure=False, pack=1)
            else:
                offs = start + tl.arange(0, BLOCK)
                acc = acc ^ tl.load(src_ptr + offs, mask=offs < hi, other=0, cache_modifier=".cg")
        tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))


def warm_words(w: torch.Tensor, max_bytes: int) -> torch.Tensor | None:
    """The first ``max_bytes`` (rounded down to 16) of contiguous ``w`` as int32 words, or None
    where ``w`` cannot be read that way (not contiguous, misaligned, too small)."""
    if not w.is_contiguous() or w.data_ptr() % ALIGN:
        return None
    nbytes = min(max_bytes, w.numel() * w.element_size()) // ALIGN * ALIGN
    if nbytes <= 0:
        return None
    return w.reshape(-1).view(torch.uint8)[:nbytes].view(torch.int32)


def plan(n_words: int, max_programs: int) -> tuple[int, int]:
    """(programs, words per program): whole BLOCKs each, no program without a block."""
    blocks = max(1, -(-n_words // BLOCK))
    per = -(-blocks // max(1, max_programs))  # blocks per program
    return -(-blocks // per), per * BLOCK


def warm_l2(w: torch.Tensor, max_bytes: int, out: torch.Tensor, *, evict_last: bool = True) -> bool:
    """Launch the read of ``w``'s first ``max_bytes`` over at most ``out.numel()`` programs
    (``out``: int32 scratch, one word per program; ``plan`` says how many write it). Returns
    False (nothing launched) where ``w`` is not eligible (``warm_words``) or Triton does not
    run the tensor."""
    words = warm_words(w, max_bytes)
    if words is None or not use_triton(w) or (evict_last and not w.is_cuda):
        return False
    programs, chunk = plan(words.numel(), out.numel())
    _warm_kernel[(programs,)](words, out, words.numel(), chunk, BLOCK=BLOCK, EVICT_LAST=evict_last,
                              num_warps=8, num_stages=4)
    return True
