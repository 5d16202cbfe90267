"""Skinny GEMM for decode: ``y [M, N] = x [M, K] @ W [N, K]^T`` with M <= GEMV_MAX_M rows.

At one to four decode rows (plain decode at small batches, MTP's verify at one request) the
linear layers are weight streams: every weight byte is read once and used M times, and a
4096-wide layer's 8-12 kernels each cost ~2-3 us of launch, ramp and tail beside a 101 us weight
floor. Two kernels, each owning ``BLOCK_N`` output columns per program and streaming their rows
of W: the FMA kernel keeps M fp32 accumulators (reduced per K tile: cheap at one row, 2-3x
slower than cuBLAS at four), the tensor-core one (``dot``) multiplies the W tile by x padded to
16 rows. ``linear`` picks per shape (``launch_config``). Two variants remove a kernel each:

- **gated** (``act``, see ``gated_mode``: on where gate_up takes the tensor-core kernel, off in
  the FMA one, where it measured slower): W is a merged ``[gate; up]`` weight [2N, K]; a
  program streams gate rows n and up rows N + n and writes ``act(gate) * up`` rounded as the
  unfused pair (gate_up rounded to the model dtype, then ``gated_act``'s roundings): bitwise
  the unfused result, one kernel and one [M, 2N] round trip fewer;
- **split-K** (``splits``): the K range is cut into ``splits`` pieces run by separate programs
  (a long-K projection such as Llama's down, K = 14336, needs more programs in flight than N
  alone gives), each writing fp32 partial sums; the last program of a column tile to finish
  (an atomic ticket per tile) adds the partials in split order and writes the result. One
  kernel instead of cuBLAS's split-K GEMM + reduce pair, and deterministic: the sum order
  never depends on which program finished last. On by default for K > SKINNY_MAX_K (4 splits):
  Gemma-4-9B's plain decode step 5.986 -> 5.870 ms with it and the in-kernel attention merge.

A split-K launch takes tickets 0..tiles-1 of the device's ticket buffer (``kernels/__init__.py``,
where the invariant is stated).

PDL (``kernels/__init__.py``): before waiting for the previous kernel, a program prefetches the
first ``PREFETCH_K`` columns of its weight rows into L2. Rounding as F.linear: fp32
accumulation, one rounding to the output dtype (the summation order differs from cuBLAS's, as
cuBLAS's differs between its own kernels).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from gpu_worker.kernels import PDL_ON, TICKETS, next_pow2, pdl, tickets, use_triton
from gpu_worker.kernels.activation import ACTS
from gpu_worker.kernels.gdc import gdc_enter, prefetch_l2

try:
    import triton
    import triton.language as tl

    from gpu_worker.kernels.activation import gated_value
except ImportError:
    triton = None

GEMV_MAX_M = 4
# Where the FMA kernel beat cuBLAS on the H200 (benchmarks/kernel_sweep.py, 2026-12-02, in a CUDA
# graph, weights rotated past L2): one row, K <= 8192, a weight of at least 16 MB — Llama-8B's
# qkv 16.5 -> 14.7 us, o 13.4 -> 11.9, gate_up 59.8 -> 54.8; without split-K its down (K =
# 14336) lost, 32.1 -> 34.5, and at four rows it lost everywhere. Elsewhere cuBLAS stays.
SKINNY_MAX_K = 8192
SKINNY_MIN_WEIGHT = 8 << 20  # elements
CONFIG = dict(block_n=8, block_k=512, num_warps=4, num_stages=3)
# The tensor-core variant (``gemv(dot=True)``, x padded to DOT_ROWS rows, tl.dot's smallest tile)
# where it measured fastest (kernel_sweep.py --only gemv, H200, h200-2026-12-03h, in a CUDA
# graph, weights rotated past L2): every weight of >= BIG_WEIGHT elements at one to four rows
# (Llama-8B's gate_up 95.8 -> 99.7 % of copy bandwidth at one row, down 89.5 -> 93.0 %; at four
# rows cuBLAS gave 99.4 / 86.8 %, this 98.4 / 89.6 %), and the smaller ones (qkv, o) at two to
# four rows (o at four rows: cuBLAS 58 %, this 66 %). One-row qkv and o keep the FMA kernel.
DOT_ROWS = 16
DOT_MAX_M = 64  # the tensor-core variant pads x to max(DOT_ROWS, next_pow2(M)) rows (sweeps up to 64)
BIG_WEIGHT = 48 << 20  # elements
BIG_CONFIG = dict(block_n=64, block_k=128, num_warps=4, num_stages=4, dot=True)
ROWS_CONFIG = dict(block_n=32, block_k=256, num_warps=4, num_stages=4, dot=True)
DEFAULT_ROWS = 4
# gate_up with the activation in its epilogue past GEMV_MAX_M rows (decode batches up to 64):
# the best tiles of kernel_sweep.py --only wide (h200-2026-12-03u) for Llama-8B's gate_up. Alone
# it streams like cuBLAS there (64 rows 63.7 vs 62.5 us, 32 rows 60.0 vs 58.3), and it saves the
# activation kernel (3.6 us a layer at 64 rows) that cuBLAS needs after it.
WIDE_GATED = ((16, BIG_CONFIG), (32, dict(block_n=64, block_k=64, num_warps=4, num_stages=4, dot=True)),
              (64, dict(block_n=64, block_k=128, num_warps=4, num_stages=3, dot=True)))
PREFETCH_K = 1024  # weight columns per row pulled into L2 before the PDL wait (16 KB a program)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    if not raw.isdigit():
        raise ValueError(f"{name}: expected a non-negative integer, got {raw!r}")
    return int(raw)


def prefetch_cols(rows: int, splits: int, chunk: int) -> int:
    """Weight columns per row a PDL-launched GEMV program pulls into L2 before its wait:
    PREFETCH_K, or with ``TANDEM_PDL_PREFETCH_MB`` as many (a power of 2, at most the K chunk) as
    keep the whole launch's prefetch within that many MB (A/Bs)."""
    raw = os.environ.get("TANDEM_PDL_PREFETCH_MB", "")
    if not raw:
        return PREFETCH_K
    cols = int(float(raw) * (1 << 20) / (2 * rows * splits))
    return 0 if cols < 16 else min(1 << (cols.bit_length() - 1), next_pow2(chunk))


def long_k_splits() -> int:
    """K splits for one-row projections with K > SKINNY_MAX_K (``TANDEM_GEMV_SPLITK``; 0 or 1 =
    cuBLAS there, as before split-K existed)."""
    return _env_int("TANDEM_GEMV_SPLITK", 4)


def short_k_splits() -> int:
    """K splits for one-row projections with K <= SKINNY_MAX_K (``TANDEM_GEMV_SPLITK_SHORT``,
    default 1: their N alone gives 512-3584 programs; 2 and 4 measured slower)."""
    return max(1, _env_int("TANDEM_GEMV_SPLITK_SHORT", 1))


def gated_config() -> dict:
    """The gated GEMV streams two row blocks per program (gate n and up I + n): half CONFIG's
    block_n each keeps a program at the 8 weight rows that measured best for the plain GEMV
    (``TANDEM_GATED_BLOCK_N`` overrides, for the layer-chain bench)."""
    return dict(CONFIG, block_n=max(1, _env_int("TANDEM_GATED_BLOCK_N", CONFIG["block_n"] // 2)))


def gated_mode() -> str:
    """Where gate_up's GEMV also applies the activation (``TANDEM_GATED_GEMV``):

    - ``auto`` (default): wherever gate_up takes the tensor-core GEMV (1-4 rows through a weight
      of >= BIG_WEIGHT elements, e.g. Llama-8B's, and up to ``gated_max_rows()`` rows of a
      decode batch through such a weight): the epilogue holds both halves of its outputs, so
      the activation kernel and a [M, 2I] round trip go for no extra weight traffic;
    - ``1``: also the FMA variant at one row through smaller weights (two row blocks a program;
      measured slower: Gemma-4-9B shape, one request, 5.870 -> 5.944 ms a step, BENCHMARKS.md
      2026-12-03);
    - ``0``: never (the merged projection, then the activation kernel)."""
    mode = os.environ.get("TANDEM_GATED_GEMV", "") or "auto"
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"TANDEM_GATED_GEMV: expected auto, 0 or 1, got {mode!r}")
    return mode


if triton is not None:

    @triton.jit
    def _accumulate(w, x_ptr, sxm, k, km, M: tl.constexpr, a0, a1, a2, a3):
        """a_m += W_tile . x[m, k] for each of the M rows (x read as float32)."""
        a0 += tl.sum(w * tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)[None, :], axis=1)
        if M > 1:
            a1 += tl.sum(w * tl.load(x_ptr + sxm + k, mask=km, other=0.0).to(tl.float32)[None, :], axis=1)
        if M > 2:
            a2 += tl.sum(w * tl.load(x_ptr + 2 * sxm + k, mask=km, other=0.0).to(tl.float32)[None, :], axis=1)
        if M > 3:
            a3 += tl.sum(w * tl.load(x_ptr + 3 * sxm + k, mask=km, other=0.0).to(tl.float32)[None, :], axis=1)
        return a0, a1, a2, a3

    @triton.jit
    def _finish(a, b, ACT: tl.constexpr, DT: tl.constexpr):
        """The output value of one row: the sum, or act(gate) * up from the gate and up sums."""
        if ACT >= 0:
            return gated_value(a.to(DT).to(tl.float32), b.to(DT).to(tl.float32), ACT, DT).to(DT)
        return a.to(DT)

    @triton.jit
    def _store_row(y_ptr, ws_ptr, m, n, nm, a, b, N, SPLITS: tl.constexpr, ACT: tl.constexpr):
        """Row m's result, or (split-K) its fp32 partials: ws[split, m, 0:N] gate, [N:2N] up."""
        if SPLITS == 1:
            tl.store(y_ptr + n, _finish(a, b, ACT, y_ptr.dtype.element_ty), mask=nm)
        else:
            tl.store(ws_ptr + m * 2 * N + n, a, mask=nm)
            if ACT >= 0:
                tl.store(ws_ptr + m * 2 * N + N + n, b, mask=nm)

    @triton.jit
    def _reduce_row(y_ptr, ws_ptr, m, n, nm, N, M: tl.constexpr, SPLITS: tl.constexpr, ACT: tl.constexpr):
        """The last program of a tile: partials summed in split order (deterministic)."""
        a = tl.zeros(n.shape, tl.float32)
        b = tl.zeros(n.shape, tl.float32)
        for s in tl.static_range(SPLITS):
            base = ws_ptr + (s * M + m) * 2 * N
            a += tl.load(base + n, mask=nm, other=0.0, cache_modifier=".cg")
            if ACT >= 0:
                b += tl.load(base + N + n, mask=nm, other=0.0, cache_modifier=".cg")
        tl.store(y_ptr + n, _finish(a, b, ACT, y_ptr.dtype.element_ty), mask=nm)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, tk_ptr, N, K, K_CHUNK, sxm, swn, sym, M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr, SPLITS: tl.constexpr,
                     PDL: tl.constexpr, PREFETCH_K: tl.constexpr):
        pid = tl.program_id(0)
        k_lo = tl.program_id(1) * K_CHUNK
        k_hi = tl.minimum(K, k_lo + K_CHUNK)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        g_rows = w_ptr + n.to(tl.int64)[:, None] * swn
        u_rows = w_ptr + (n + N).to(tl.int64)[:, None] * swn  # gated: the up half of [gate; up]
        if PREFETCH_K > 0:  # weights only, before the wait (one prefetch per 32-byte sector)
            sec = tl.minimum(k_lo + tl.arange(0, PREFETCH_K // 16) * 16, K - 1)
            prefetch_l2(w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * swn + sec[None, :], PDL)
        gdc_enter(PDL)
        k0 = tl.arange(0, BLOCK_K)
        a0 = tl.zeros([BLOCK_N], tl.float32)
        a1, a2, a3 = a0, a0, a0
        b0, b1, b2, b3 = a0, a0, a0, a0
        for start in range(k_lo, k_hi, BLOCK_K):
            k = start + k0
            km = k < k_hi
            wm = nm[:, None] & km[None, :]
            w = tl.load(g_rows + k[None, :], mask=wm, other=0.0).to(tl.float32)
            a0, a1, a2, a3 = _accumulate(w, x_ptr, sxm, k, km, M, a0, a1, a2, a3)
            if ACT >= 0:
                w = tl.load(u_rows + k[None, :], mask=wm, other=0.0).to(tl.float32)
                b0, b1, b2, b3 = _accumulate(w, x_ptr, sxm, k, km, M, b0, b1, b2, b3)
        ws = ws_ptr + tl.program_id(1) * M * 2 * N
        _store_row(y_ptr, ws, 0, n, nm, a0, b0, N, SPLITS, ACT)
        if M > 1:
            _store_row(y_ptr + sym, ws, 1, n, nm, a1, b1, N, SPLITS, ACT)
        if M > 2:
            _store_row(y_ptr + 2 * sym, ws, 2, n, nm, a2, b2, N, SPLITS, ACT)
        if M > 3:
            _store_row(y_ptr + 3 * sym, ws, 3, n, nm, a3, b3, N, SPLITS, ACT)
        if SPLITS > 1:
            # every thread's partial stores precede the ticket (the barrier), which releases them
            # at GPU scope; the last taker acquires them and bypasses L1 to read them
            tl.debug_barrier()
            if tl.atomic_add(tk_ptr + pid, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                for m in tl.static_range(M):
                    _reduce_row(y_ptr + m * sym, ws_ptr, m, n, nm, N, M, SPLITS, ACT)
                tl.atomic_xchg(tk_ptr + pid, 0, sem="relaxed", scope="gpu")  # back to 0 for the next launch

    @triton.jit
    def _dot_rows(pid, N, BLOCK_N: tl.constexpr, ACT: tl.constexpr):
        """The weight rows of a tensor-core program's tile and their mask. Gated (``ACT`` >= 0):
        W = [gate; up] [2N, K] and the tile is BLOCK_N / 2 gate rows then the matching up rows,
        so the program holds both halves of its outputs (no weight re-layout: the rows are
        gathered, each still read along K)."""
        i = tl.arange(0, BLOCK_N)
        if ACT >= 0:
            HALF: tl.constexpr = BLOCK_N // 2
            j = pid * HALF + (i % HALF)
            return j + (i // HALF) * N, j < N
        n = pid * BLOCK_N + i
        return n, n < N

    @triton.jit(do_not_specialize=["rows"])
    def _gemv_dot_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, tk_ptr, N, K, K_CHUNK, sxm, swn, sym, rows, M: tl.constexpr,
                         MP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr,
                         SPLITS: tl.constexpr, ROWS_RT: tl.constexpr, F32: tl.constexpr, PDL: tl.constexpr,
                         PREFETCH_K: tl.constexpr):
        """Tensor-core variant for 1..DOT_MAX_M rows: acc [BLOCK_N, MP] += W tile @ x tile^T (x
        padded to MP rows, read as zeros). The FMA kernel above reduces every tile once per row, which at
        four rows made it 2-3x slower than cuBLAS (BENCHMARKS.md 2026-12-03, ``h200-2026-12-03g``).
        Gated (``ACT`` >= 0): the epilogue splits the accumulator into its gate and up halves and
        writes ``act(gate) * up`` [M, N] (the activation kernel's work, in registers).
        ``ROWS_RT``: the row count is the runtime ``rows`` (decode batches past GEMV_MAX_M share
        one compiled variant per MP), else the constexpr M (1-4 rows, split-K)."""
        pid = tl.program_id(0)
        k_lo = tl.program_id(1) * K_CHUNK
        k_hi = tl.minimum(K, k_lo + K_CHUNK)
        w_idx, nm = _dot_rows(pid, N, BLOCK_N, ACT)
        r = tl.arange(0, MP)
        if ROWS_RT:
            rm = r < rows
        else:
            rm = r < M
        w_rows = w_ptr + w_idx.to(tl.int64)[:, None] * swn
        if PREFETCH_K > 0:  # as in _gemv_kernel: weights only, before the wait
            sec = tl.minimum(k_lo + tl.arange(0, PREFETCH_K // 16) * 16, K - 1)
            prefetch_l2(w_ptr + tl.where(nm, w_idx, 0).to(tl.int64)[:, None] * swn + sec[None, :], PDL)
        gdc_enter(PDL)
        acc = tl.zeros([BLOCK_N, MP], tl.float32)
        for start in range(k_lo, k_hi, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            km = k < k_hi
            w = tl.load(w_rows + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            xt = tl.load(x_ptr + r[None, :] * sxm + k[:, None], mask=rm[None, :] & km[:, None], other=0.0)
            if F32:  # the interpreter's tl.dot on bf16 returns garbage (Triton 3.6): exact fp32 there
                w, xt = w.to(tl.float32), xt.to(tl.float32)
            acc = tl.dot(w, xt, acc)
        ws = ws_ptr + tl.program_id(1) * M * 2 * N  # the FMA kernel's layout: [split, m, 2N]
        if ACT >= 0:
            HALF: tl.constexpr = BLOCK_N // 2
            g, u = tl.split(tl.permute(tl.reshape(acc, [2, HALF, MP]), [1, 2, 0]))
            n = pid * HALF + tl.arange(0, HALF)
            out_m = rm[None, :] & (n < N)[:, None]
            if SPLITS == 1:
                tl.store(y_ptr + r[None, :] * sym + n[:, None], _finish(g, u, ACT, y_ptr.dtype.element_ty), mask=out_m)
            else:
                tl.store(ws + r[None, :] * 2 * N + n[:, None], g, mask=out_m)
                tl.store(ws + r[None, :] * 2 * N + N + n[:, None], u, mask=out_m)
        else:
            n = w_idx
            out_m = rm[None, :] & nm[:, None]
            if SPLITS == 1:
                tl.store(y_ptr + r[None, :] * sym + n[:, None], acc.to(y_ptr.dtype.element_ty), mask=out_m)
            else:
                tl.store(ws + r[None, :] * 2 * N + n[:, None], acc, mask=out_m)
        if SPLITS > 1:
            tl.debug_barrier()  # as in _gemv_kernel: partials before the ticket
            if tl.atomic_add(tk_ptr + pid, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                for m in tl.static_range(M):
                    _reduce_row(y_ptr + m * sym, ws_ptr, m, n, n < N, N, M, SPLITS, ACT)
                tl.atomic_xchg(tk_ptr + pid, 0, sem="relaxed", scope="gpu")


def gemv(x: torch.Tensor, w: torch.Tensor, *, act: str | None = None, splits: int = 1, block_n: int = 16,
         block_k: int = 512, num_warps: int = 4, num_stages: int = 3, prefetch_k: int | None = None,
         dot: bool = False) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_M, unit column stride), w [N, K] contiguous -> [M, N].

    With ``act``, w is a merged [gate; up] weight [2N, K] and the result ``act(x @ gate^T) *
    (x @ up^T)`` [M, N]. ``splits`` > 1 cuts K into that many pieces (one kernel, deterministic
    sum). ``dot`` takes the tensor-core variant (up to DOT_MAX_M rows; with ``act`` a program
    holds ``block_n`` / 2 gate rows and their up rows).
    ``prefetch_k`` overrides PREFETCH_K (benchmarks)."""
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
    splits = max(1, min(int(splits), triton.cdiv(k, block_k)))
    chunk = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, chunk)  # no empty split: every program takes its ticket after real work
    ws = tk = y
    if splits > 1:
        assert tiles <= TICKETS, (n, block_n)
        ws = torch.empty((splits, m, 2 * n), dtype=torch.float32, device=x.device)
        tk = tickets(x.device)
    on = pdl(x, "gemv")
    pre = (prefetch_cols(rows, splits, chunk) if prefetch_k is None else prefetch_k) if on == PDL_ON else 0
    if dot:
        mp = max(DOT_ROWS, next_pow2(m))
        rt = m > GEMV_MAX_M and splits == 1  # one variant per MP for decode batches (no compile per size)
        _gemv_dot_kernel[(tiles, splits)](
            x, w, y, ws, tk, n, k, chunk, x.stride(0), w.stride(0), y.stride(0), m, M=mp if rt else m, MP=mp,
            BLOCK_N=block_n, BLOCK_K=block_k, ACT=ACTS[act] if act else -1, SPLITS=splits, ROWS_RT=rt,
            F32=not x.is_cuda, PDL=on, PREFETCH_K=pre, num_warps=num_warps, num_stages=num_stages, launch_pdl=on == PDL_ON,
        )
        return y
    _gemv_kernel[(tiles, splits)](
        x, w, y, ws, tk, n, k, chunk, x.stride(0), w.stride(0), y.stride(0), M=m, BLOCK_N=block_n,
        BLOCK_K=block_k, ACT=ACTS[act] if act else -1, SPLITS=splits, PDL=on, PREFETCH_K=pre,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=on == PDL_ON,
    )
    return y


def skinny_rows() -> int:
    """The most rows a projection sends through the GEMV (``TANDEM_GEMV_ROWS``, 1..GEMV_MAX_M):
    one decode row, and up to GEMV_MAX_M for MTP's verify at one request (T = S + 1 = 4 rows)."""
    n = _env_int("TANDEM_GEMV_ROWS", DEFAULT_ROWS)
    if not 1 <= n <= GEMV_MAX_M:
        raise ValueError(f"TANDEM_GEMV_ROWS: expected 1..{GEMV_MAX_M}, got {n}")
    return n


def dot_enabled() -> bool:
    """``TANDEM_GEMV_DOT=0``: no tensor-core variant (the FMA kernel at one row, cuBLAS above; A/Bs)."""
    return os.environ.get("TANDEM_GEMV_DOT", "1") != "0"


def launch_config(m: int, w: torch.Tensor) -> dict | None:
    """The GEMV's launch for ``m`` rows through ``w``, or None for cuBLAS."""
    if not dot_enabled():
        return CONFIG if m == 1 else None
    if w.numel() >= BIG_WEIGHT:
        return BIG_CONFIG
    return CONFIG if m == 1 else ROWS_CONFIG


def _operands(x: torch.Tensor, w: torch.Tensor, lo: int, hi: int, min_weight: int) -> bool:
    """x [lo..hi rows, K] in a half dtype with unit column stride, a contiguous w of at least
    ``min_weight`` elements, on the kernel path: what every GEMV launch needs."""
    return (x.dim() == 2 and lo <= x.shape[0] <= hi and x.dtype in (torch.bfloat16, torch.float16)
            and w.numel() >= min_weight and x.stride(1) == 1 and w.is_contiguous() and use_triton(x))


def _skinny(x: torch.Tensor, w: torch.Tensor, rows: int | None = None) -> bool:
    """Whether ``x`` through ``w`` takes a GEMV: at most ``rows`` rows (default ``skinny_rows()``,
    read only for calls of at most GEMV_MAX_M rows: prefill projections never touch the environment)."""
    return (_operands(x, w, 1, GEMV_MAX_M, SKINNY_MIN_WEIGHT)
            and x.shape[0] <= (skinny_rows() if rows is None else rows))


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the GEMV where it measured faster: up to ``skinny_rows()`` rows through a
    mid-sized weight, split-K past SKINNY_MAX_K. Decode batches (16-256 rows) stay with cuBLAS:
    a Triton small-M GEMM (M x N tiles, split K) measured slower there on the H200
    (BENCHMARKS.md, 2026-12-02 night)."""
    cfg = launch_config(x.shape[0], w) if bias is None and _skinny(x, w) else None
    if cfg is not None:
        if w.shape[1] <= SKINNY_MAX_K:
            return gemv(x, w, splits=short_k_splits(), **cfg)
        splits = long_k_splits()
        if splits > 1:
            return gemv(x, w, splits=splits, **cfg)
    return F.linear(x, w, bias)


def gated_max_rows() -> int:
    """The most rows a big gate_up takes through the gated tensor-core GEMV
    (``TANDEM_GATED_MAX_M``, default 64; 4 keeps cuBLAS + the activation kernel above 4 rows)."""
    return min(_env_int("TANDEM_GATED_MAX_M", WIDE_GATED[-1][0]), WIDE_GATED[-1][0])


def wide_gated_config(m: int) -> dict:
    return next(cfg for rows, cfg in WIDE_GATED if m <= rows)


def _wide(x: torch.Tensor, w: torch.Tensor) -> bool:
    """A decode batch of GEMV_MAX_M < rows <= gated_max_rows() through a big gate_up weight."""
    return (_operands(x, w, GEMV_MAX_M + 1, DOT_MAX_M, BIG_WEIGHT) and w.shape[1] <= SKINNY_MAX_K
            and dot_enabled() and x.shape[0] <= gated_max_rows())


def gated_linear(x: torch.Tensor, gate_up: torch.Tensor, act: str) -> torch.Tensor | None:
    """``act(x @ gate^T) * (x @ up^T)`` in one GEMV (gate_up = [gate; up], [2I, K]) where
    ``gated_mode()`` allows it, or None: the caller runs the merged projection and the
    activation separately (small weights, batches past 64 rows, the torch path, switched off).
    Bitwise the same GEMV then the activation kernel: the same sums, rounded to the model
    dtype, then the activation's roundings."""
    mode = gated_mode()
    if act not in ACTS or mode == "0":
        return None
    if _wide(x, gate_up):
        return gemv(x, gate_up, act=act, **wide_gated_config(x.shape[0]))
    if not _skinny(x, gate_up):
        return None
    if gate_up.shape[1] <= SKINNY_MAX_K:
        splits = short_k_splits()
    elif (splits := long_k_splits()) <= 1:
        return None  # cuBLAS there, as ``linear``
    cfg = launch_config(x.shape[0], gate_up)
    if cfg is not None and cfg.get("dot"):
        return gemv(x, gate_up, act=act, splits=splits, **cfg)
    if mode == "1" and x.shape[0] == 1 and gate_up.shape[1] <= SKINNY_MAX_K:
        return gemv(x, gate_up, act=act, splits=splits, **gated_config())
    return None
