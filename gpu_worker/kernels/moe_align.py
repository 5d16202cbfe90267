"""Token-to-expert alignment for the grouped MoE GEMMs (``moe_gemm.py``), as the fused-MoE
kernels of vLLM and SGLang lay it out.

The T*K (token, slot) pairs are numbered ``pair = token * K + slot``. Each expert gets a run of
whole ``BLOCK_M``-row blocks holding its pairs (its count rounded up to a multiple of
BLOCK_M); runs follow in expert order. Outputs, all of sizes fixed by (T*K, E, BLOCK_M) so the
launches replay in CUDA graphs (``AlignBuffers``):

- ``sorted_ids [max_padded]``: the pair in each row, ``n_pairs`` on padding rows;
- ``block_expert [max_blocks]``: each block's expert, -1 past the last used block;
- ``n_padded [1]``: the used rows (a multiple of BLOCK_M); the GEMM's programs past it exit.

Two kernels: ``_count_kernel`` (one program: counts per expert, the runs, the block map, every
row set to padding, and each expert's first free row in ``cursor``) and ``_place_kernel``
(programs over the pairs: each takes its row with an atomic increment of its expert's cursor).
Where all pairs fit one program (``PLACE_IN_COUNT``: small batches) the counting program places
them too, one launch. Both run only in forwards of more than DECODE_MAX_TOKENS tokens, which
launch without PDL (``kernels/__init__.py``). The order of pairs inside an expert's run follows
the atomics and may vary between runs; no value does: a pair's GEMM row depends only on its
own input row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.kernels import next_pow2

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

CHUNK = 1024  # pairs a program reads at once
BLOCK_CHUNK = 64  # blocks the counting program maps at once (a [BLOCK_CHUNK, E] comparison)
PLACE_IN_COUNT = 4096  # up to this many pairs, the counting program places them as well

if triton is not None:

    @triton.jit
    def _place(ids_ptr, cursor_ptr, sorted_ptr, start, n_pairs, CHUNK: tl.constexpr):
        i = start + tl.arange(0, CHUNK)
        m = i < n_pairs
        e = tl.load(ids_ptr + i, mask=m, other=0)
        row = tl.atomic_add(cursor_ptr + e, 1, mask=m)
        tl.store(sorted_ptr + row, i, mask=m)

    # The pair and row counts vary with every step's token count: not specialised on (no compile
    # per new size while serving).
    @triton.jit(do_not_specialize=["n_pairs", "max_padded", "max_blocks"])
    def _count_kernel(ids_ptr, cursor_ptr, sorted_ptr, block_expert_ptr, n_padded_ptr, n_pairs, E, max_padded,
                      max_blocks, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK_CHUNK: tl.constexpr, PLACE: tl.constexpr):
        e = tl.arange(0, BLOCK_E)
        counts = tl.zeros([BLOCK_E], tl.int32)
        for start in range(0, n_pairs, CHUNK):
            i = start + tl.arange(0, CHUNK)
            ids = tl.load(ids_ptr + i, mask=i < n_pairs, other=0)
            counts += tl.histogram(ids, BLOCK_E, mask=i < n_pairs)
        padded = tl.where(e < E, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
        ends = tl.cumsum(padded, axis=0)
        starts = ends - padded
        total = tl.sum(padded, axis=0)
        tl.store(n_padded_ptr, total)
        tl.store(cursor_ptr + e, starts, mask=e < E)
        for start in range(0, max_padded, CHUNK):
            r = start + tl.arange(0, CHUNK)
            tl.store(sorted_ptr + r, tl.zeros([CHUNK], tl.int32) + n_pairs, mask=r < max_padded)
        for start in range(0, max_blocks, BLOCK_CHUNK):
            b = start + tl.arange(0, BLOCK_CHUNK)
            row = b * BLOCK_M
            # the expert whose run holds `row`: how many runs end at or before it
            owner = tl.sum(((ends[None, :] <= row[:, None]) & (e[None, :] < E)).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + b, tl.where(row < total, owner, -1), mask=b < max_blocks)
        if PLACE:
            tl.debug_barrier()  # the padding fill and the cursors before any placement
            for start in range(0, n_pairs, CHUNK):
                _place(ids_ptr, cursor_ptr, sorted_ptr, start, n_pairs, CHUNK)

    @triton.jit(do_not_specialize=["n_pairs"])
    def _place_kernel(ids_ptr, cursor_ptr, sorted_ptr, n_pairs, CHUNK: tl.constexpr):
        _place(ids_ptr, cursor_ptr, sorted_ptr, tl.program_id(0) * CHUNK, n_pairs, CHUNK)


def max_padded_rows(n_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows the runs can take: every used expert wastes at most BLOCK_M - 1 rows."""
    return n_pairs + min(n_pairs, num_experts) * (block_m - 1)


@dataclass(frozen=True)
class AlignBuffers:
    sorted_ids: torch.Tensor  # [max_padded] int32
    block_expert: torch.Tensor  # [max_blocks] int32
    n_padded: torch.Tensor  # [1] int32
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


def align_block(ids: torch.Tensor, num_experts: int, block_m: int) -> AlignBuffers:
    """ids [T, K] int32 -> the pairs in expert runs of whole BLOCK_M blocks (module docstring)."""
    n = ids.numel()
    dev = ids.device
    max_padded = max_padded_rows(n, num_experts, block_m)
    blocks = triton.cdiv(max_padded, block_m)
    out = AlignBuffers(torch.empty(max_padded, dtype=torch.int32, device=dev),
                       torch.empty(blocks, dtype=torch.int32, device=dev),
                       torch.empty(1, dtype=torch.int32, device=dev), block_m)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    flat = ids.reshape(-1)
    place = n <= PLACE_IN_COUNT
    _count_kernel[(1,)](flat, cursor, out.sorted_ids, out.block_expert, out.n_padded, n, num_experts, max_padded,
                        blocks, BLOCK_E=next_pow2(num_experts), BLOCK_M=block_m, CHUNK=CHUNK, BLOCK_CHUNK=BLOCK_CHUNK,
                        PLACE=place, num_warps=8)
    if not place:
        _place_kernel[(triton.cdiv(n, CHUNK),)](flat, cursor, out.sorted_ids, n, CHUNK=CHUNK, num_warps=4)
    return out
