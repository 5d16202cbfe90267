"""Skinny GEMM for decode: ``y [M, N] = x [M, K] @ W [N, K]^T`` with M <= GEMV_MAX_M rows.

At one to four decode rows (plain decode at small batches, MTP's verify at one request) the
linear layers are weight streams: every weight byte is read once and used M times, and cuBLAS's
launch, ramp and tail are a large share of each projection. Two kernels, each owning ``BLOCK_N``
output columns per program and streaming their rows of W: the FMA kernel keeps M fp32
accumulators (reduced per K tile: cheap at one row, slower than cuBLAS at four), the tensor-core
one (``dot``) multiplies the W tile by x padded to 16 rows (the kernels: ``gemv_kernels.py``).
``linear`` picks per shape (``launch_config``). Two variants remove a kernel each:

- **gated** (``act``): W is a merged ``[gate; up]`` weight [2N, K]; a program streams gate rows n
  and up rows N + n and writes ``act(gate) * up`` rounded as the unfused pair (gate_up rounded to
  the model dtype, then ``gated_act``'s roundings): bitwise the unfused result, one kernel and one
  [M, 2N] round trip fewer. Only where gate_up takes the tensor-core kernel: in the FMA kernel two
  row blocks a program are slower than the separate activation;
- **split-K** (``splits``): the K range is cut into ``splits`` pieces run by separate programs
  (a long-K projection such as Llama's down, K = 14336, needs more programs in flight than N
  alone gives), each writing fp32 partial sums; the last program of a column tile to finish
  (an atomic ticket per tile) adds the partials in split order and writes the result. One
  kernel instead of cuBLAS's split-K GEMM + reduce pair, and deterministic: the sum order
  never depends on which program finished last. Used for K > SKINNY_MAX_K (LONG_K_SPLITS) and
  for short-K launches with fewer column tiles than SMs (``short_k_splits``).

A split-K launch takes tickets 0..tiles-1 of the device's ticket buffer (``kernels/__init__.py``,
where the invariant is stated).

PDL (``kernels/__init__.py``): before waiting for the previous kernel, a program prefetches the
first columns of its weight rows into L2 (``prefetch_cols``: PREFETCH_MB for the whole launch).
Rounding as F.linear: fp32 accumulation, one rounding to the output dtype (the summation order
differs from cuBLAS's, as cuBLAS's differs between its own kernels).

Why these shapes and thresholds: docs/decisions/gemv.md.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from gpu_worker.kernels import PDL_ON, TICKETS, next_pow2, pdl, tickets, use_triton
from gpu_worker.kernels.activation import ACTS

try:
    import triton

    from gpu_worker.kernels.gemv_kernels import _gemv_dot_kernel, _gemv_kernel
except ImportError:
    triton = None

GEMV_MAX_M = 4  # one decode row, and MTP's verify at one request (T = S + 1 = 4 rows)
# The FMA kernel beats cuBLAS at one row for K <= SKINNY_MAX_K; past it, only split K by
# LONG_K_SPLITS does.
SKINNY_MAX_K = 8192
LONG_K_SPLITS = 4
# The smallest weight (elements) that takes a GEMV. Inside a one-row decode graph a GEMV is a link
# of the PDL chain and a cuBLAS kernel breaks it, so small weights gain too.
SKINNY_MIN_WEIGHT = 2 << 20
# Short-K launches with fewer column tiles than the GPU has SMs split K into FILL_PER_SM
# programs per SM (each split at least MIN_SPLIT_TILES K tiles): ``short_k_splits``.
FILL_PER_SM = 3
MIN_SPLIT_TILES = 2
CONFIG = dict(block_n=8, block_k=512, num_warps=4, num_stages=3)
# The tensor-core variant (``gemv(dot=True)``, x padded to DOT_ROWS rows, tl.dot's smallest tile):
# every weight of >= BIG_WEIGHT elements at one to four rows, and the smaller ones at two to four
# rows; one-row qkv and o projections keep the FMA kernel.
DOT_ROWS = 16
DOT_MAX_M = 64  # the tensor-core variant pads x to max(DOT_ROWS, next_pow2(M)) rows
BIG_WEIGHT = 48 << 20  # elements
BIG_CONFIG = dict(block_n=64, block_k=128, num_warps=4, num_stages=4, dot=True)
ROWS_CONFIG = dict(block_n=32, block_k=256, num_warps=4, num_stages=4, dot=True)
# gate_up with the activation in its epilogue past GEMV_MAX_M rows (decode batches up to 64 rows,
# big weights): it streams like cuBLAS and saves the activation kernel cuBLAS needs after it.
WIDE_GATED = ((16, BIG_CONFIG), (32, dict(block_n=64, block_k=64, num_warps=4, num_stages=4, dot=True)),
              (64, dict(block_n=64, block_k=128, num_warps=4, num_stages=3, dot=True)))
# Weight bytes a PDL-launched GEMV pulls into L2 before its wait, the whole launch together (its
# first columns in every row): enough to cover the previous kernel's tail, far less than L2.
PREFETCH_MB = 4.0


def prefetch_cols(rows: int, splits: int, chunk: int, mb: float = PREFETCH_MB, elt: int = 2) -> int:
    """Weight columns per row a PDL-launched GEMV program pulls into L2 before its wait: as many
    (a power of 2, at least 16, at most the K chunk) as keep the launch's prefetch within ``mb``
    megabytes (0: none); ``elt``: bytes a weight element."""
    cols = int(mb * (1 << 20) / (elt * rows * splits))
    return 0 if cols < 16 else min(1 << (cols.bit_length() - 1), next_pow2(chunk))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; off CUDA (the CPU twin under the interpreter) 132,
    so the CPU takes the launch decisions a Hopper card would."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def short_k_splits(tiles: int, k: int, block_k: int, device: torch.device) -> int:
    """K splits for a projection with K <= SKINNY_MAX_K whose launch has ``tiles`` column tiles:
    none while there are at least as many tiles as SMs, else enough that tiles x splits reaches
    FILL_PER_SM programs per SM, each split at least MIN_SPLIT_TILES K tiles long. A narrow
    projection (an assistant's o, a small model's o and down) otherwise leaves most SMs idle and
    streams at half the bandwidth of a wide one."""
    sms = sm_count(device)
    if tiles >= sms:
        return 1
    return max(1, min(-(-FILL_PER_SM * sms // tiles), k // (MIN_SPLIT_TILES * block_k)))


def launch_tiles(rows: int, cfg: dict, gated: bool = False) -> int:
    """Column tiles of a GEMV launch through a weight of ``rows`` rows (``gemv``'s grid.x):
    gated, the FMA kernel holds ``block_n`` outputs (2 x block_n weight rows) a program and the
    tensor-core one ``block_n`` / 2 outputs (``block_n`` rows)."""
    per = cfg["block_n"] if not gated or cfg.get("dot") else 2 * cfg["block_n"]
    return -(-rows // per)


def split_k(y: torch.Tensor, k: int, splits: int, step: int, tiles: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """A split-K launch's K chunk (a multiple of ``step``), its split count (no empty split: every
    program takes its ticket after real work), the fp32 partials [splits, M, 2N] for output ``y``
    [M, N] and the device's tickets (``y`` itself stands in for both when unsplit)."""
    splits = max(1, min(int(splits), triton.cdiv(k, step)))
    chunk = triton.cdiv(triton.cdiv(k, splits), step) * step
    splits = triton.cdiv(k, chunk)
    if splits == 1:
        return chunk, 1, y, y
    assert tiles <= TICKETS, (y.shape, tiles)
    m, n = y.shape
    return chunk, splits, torch.empty((splits, m, 2 * n), dtype=torch.float32, device=y.device), tickets(y.device)


def gemv(x: torch.Tensor, w: torch.Tensor, *, act: str | None = None, splits: int = 1, block_n: int = 16,
         block_k: int = 512, num_warps: int = 4, num_stages: int = 3, prefetch_k: int | None = None,
         dot: bool = False) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_M, unit column stride), w [N, K] contiguous -> [M, N].

    With ``act``, w is a merged [gate; up] weight [2N, K] and the result ``act(x @ gate^T) *
    (x @ up^T)`` [M, N]. ``splits`` > 1 cuts K into that many pieces (one kernel, deterministic
    sum). ``dot`` takes the tensor-core variant (up to DOT_MAX_M rows; with ``act`` a program
    holds ``block_n`` / 2 gate rows and their up rows). ``prefetch_k`` overrides
    ``prefetch_cols`` (benchmarks). FP8 weights take ``fp8_linear.py``'s kernels."""
    m, k = x.shape
    rows = w.shape[0]
    n = rows // 2 if act else rows
    assert m <= (DOT_MAX_M if dot else GEMV_MAX_M) and x.stride(1) == 1 and w.stride(1) == 1 and w.shape[1] == k, (
        x.shape, w.shape)
    assert not act or (rows % 2 == 0 and (not dot or block_n % 2 == 0)), (w.shape, block_n)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if not m:
        return y
    tiles = triton.cdiv(n, block_n // 2 if act and dot else block_n)
    chunk, splits, ws, tk = split_k(y, k, splits, block_k, tiles)
    on = pdl(x)
    if on != PDL_ON:
        pre = 0
    else:
        pre = prefetch_cols(rows, splits, chunk, elt=w.element_size()) if prefetch_k is None else prefetch_k
    if dot:
        mp = max(DOT_ROWS, next_pow2(m))
        rt = m > GEMV_MAX_M and splits == 1  # one variant per MP for decode batches (no compile per size)
        _gemv_dot_kernel[(tiles, splits)](
            x, w, y, ws, tk, n, k, chunk, x.stride(0), w.stride(0), y.stride(0), m, M=mp if rt else m,
            MP=mp, BLOCK_N=block_n, BLOCK_K=block_k, ACT=ACTS[act] if act else -1, SPLITS=splits, ROWS_RT=rt,
            F32=not x.is_cuda or x.dtype == torch.float32, PDL=on, PREFETCH_K=pre, num_warps=num_warps, num_stages=num_stages,
            launch_pdl=on == PDL_ON,
        )
        return y
    _gemv_kernel[(tiles, splits)](
        x, w, y, ws, tk, n, k, chunk, x.stride(0), w.stride(0), y.stride(0), M=m, BLOCK_N=block_n,
        BLOCK_K=block_k, ACT=ACTS[act] if act else -1, SPLITS=splits, PDL=on, PREFETCH_K=pre,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=on == PDL_ON,
    )
    return y


def launch_config(m: int, w: torch.Tensor) -> dict:
    """The GEMV's launch for ``m`` (<= GEMV_MAX_M) rows through ``w``."""
    if w.numel() >= BIG_WEIGHT:
        return BIG_CONFIG
    return CONFIG if m == 1 else ROWS_CONFIG


def _operands(x: torch.Tensor, w: torch.Tensor, lo: int, hi: int, min_weight: int) -> bool:
    """x [lo..hi rows, K] in a half dtype with unit column stride, a contiguous w of at least
    ``min_weight`` elements, on the kernel path: what every GEMV launch needs."""
    # The shape test comes last: a traced shape (torch.export on the CPU) is never compared.
    return (use_triton(x) and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2
            and w.numel() >= min_weight and x.stride(1) == 1 and w.is_contiguous() and lo <= x.shape[0] <= hi)


def skinny(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``x`` through ``w`` takes a GEMV (1..GEMV_MAX_M rows, a weight of at least
    SKINNY_MIN_WEIGHT elements, the kernel path)."""
    return _operands(x, w, 1, GEMV_MAX_M, SKINNY_MIN_WEIGHT)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the GEMV where it is faster: up to GEMV_MAX_M rows through a mid-sized
    weight, split-K past SKINNY_MAX_K. Decode batches (16-256 rows) stay with cuBLAS, which a
    Triton small-M GEMM does not beat there."""
    if bias is not None or not skinny(x, w):
        return F.linear(x, w, bias)
    cfg = launch_config(x.shape[0], w)
    return gemv(x, w, splits=_splits(w, cfg, x.device), **cfg)


def _splits(w: torch.Tensor, cfg: dict, device: torch.device, gated: bool = False) -> int:
    k = w.shape[1]
    if k > SKINNY_MAX_K:
        return LONG_K_SPLITS
    return short_k_splits(launch_tiles(w.shape[0], cfg, gated), k, cfg["block_k"], device)


def wide_gated_config(m: int) -> dict:
    return next(cfg for rows, cfg in WIDE_GATED if m <= rows)


def _wide(x: torch.Tensor, w: torch.Tensor) -> bool:
    """A decode batch of GEMV_MAX_M < rows <= 64 through a big gate_up weight."""
    return (_operands(x, w, GEMV_MAX_M + 1, WIDE_GATED[-1][0], BIG_WEIGHT) and w.shape[1] <= SKINNY_MAX_K)


def gated_linear(x: torch.Tensor, gate_up: torch.Tensor, act: str) -> torch.Tensor | None:
    """``act(x @ gate^T) * (x @ up^T)`` in one GEMV (gate_up = [gate; up], [2I, K]) where gate_up
    takes the tensor-core kernel, or None: the caller runs the merged projection and the
    activation separately (small weights, batches past 64 rows, the torch path). Bitwise the same
    GEMV then the activation kernel: the same sums, rounded to the model dtype, then the
    activation's roundings."""
    if act not in ACTS:
        return None
    if _wide(x, gate_up):
        return gemv(x, gate_up, act=act, **wide_gated_config(x.shape[0]))
    if not skinny(x, gate_up):
        return None
    cfg = launch_config(x.shape[0], gate_up)
    if not cfg.get("dot"):
        return None
    return gemv(x, gate_up, act=act, splits=_splits(gate_up, cfg, x.device, gated=True), **cfg)
