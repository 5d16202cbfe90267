"""Skinny GEMM for decode: ``y [M, N] = x [M, K] @ W [N, K]^T`` with M <= GEMV_MAX_M rows.

At one to four decode rows (plain decode at small batches, MTP's verify at one request) the
linear layers are weight streams: every weight byte is read once and used M times, and a
4096-wide layer's 8-12 kernels each cost ~2-3 us of launch, ramp and tail beside a 101 us weight
floor. Two kernels, each owning ``BLOCK_N`` output columns per program and streaming their rows
of W: the FMA kernel keeps M fp32 accumulators (reduced per K tile: cheap at one row, 2-3x
slower than cuBLAS at four), the tensor-core one (``dot``) multiplies the W tile by x padded to
16 rows (the kernels: ``kernels/gemv_kernels.py``). ``linear`` picks per shape
(``launch_config``). Two variants remove a kernel each:

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
  Gemma-4-9B's plain decode step 5.986 -> 5.870 ms with it and the in-kernel attention merge;
  and for short-K launches with fewer column tiles than SMs (``short_k_splits``).

A split-K launch takes tickets 0..tiles-1 of the device's ticket buffer (``kernels/__init__.py``,
where the invariant is stated).

PDL (``kernels/__init__.py``): before waiting for the previous kernel, a program prefetches the
first columns of its weight rows into L2 (``prefetch_cols``: PREFETCH_MB for the whole launch).
Rounding as F.linear: fp32 accumulation, one rounding to the output dtype (the summation order
differs from cuBLAS's, as cuBLAS's differs between its own kernels).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from gpu_worker.kernels import PDL_ON, TICKETS, next_pow2, pdl, tickets, use_triton
from gpu_worker.kernels.activation import ACTS

try:
    import triton

    from gpu_worker.kernels.gemv_kernels import _gemv_dot_kernel, _gemv_kernel
except ImportError:
    triton = None

GEMV_MAX_M = 4
# Where the FMA kernel beat cuBLAS on the H200 (benchmarks/kernel_sweep.py, 2026-12-02, in a CUDA
# graph, weights rotated past L2): one row, K <= 8192 — Llama-8B's qkv 16.5 -> 14.7 us, o 13.4
# -> 11.9, gate_up 59.8 -> 54.8; without split-K its down (K = 14336) lost, 32.1 -> 34.5, and
# at four rows it lost everywhere. Elsewhere cuBLAS stays. The smallest weight was 8M elements
# until the engine A/B of 2026-12-04 (evening): inside the one-row decode graph a GEMV is a link
# of the PDL chain and a cuBLAS kernel breaks it, so smaller weights gain more there than alone.
# Qwen3-0.6B at one request, decode ms/step, same machine: 8M 1.422, 4M 1.256, 2M 0.980, 1M
# 0.960 (its o 2M and down 3M elements; nothing of it lies between 1M and 2M); the Gemma-4 9B
# MTP step 6.734 -> 6.706 ms (the assistant's 4M-element projections).
SKINNY_MAX_K = 8192
# Short-K launches with fewer column tiles than the GPU has SMs split K into FILL_PER_SM
# programs per SM (each split at least MIN_SPLIT_TILES K tiles): ``short_k_splits``.
FILL_PER_SM = 3
MIN_SPLIT_TILES = 2
SKINNY_MIN_WEIGHT = 2 << 20  # elements; TANDEM_GEMV_MIN_WEIGHT overrides (read at import, below)
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
# Weight bytes a PDL-launched GEMV pulls into L2 before its wait, the whole launch together (its
# first columns in every row). The 8B's one-row step on the H200 (BENCHMARKS.md 2026-12-04):
# 2-8 MB 4.205-4.211 ms, none 4.241, 16 MB 4.235; the former 1024 columns a row (gate_up: 56 MB,
# more than L2 holds) 4.359, slower than without PDL.
PREFETCH_MB = 4.0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    if not raw.isdigit():
        raise ValueError(f"{name}: expected a non-negative integer, got {raw!r}")
    return int(raw)


# For A/Bs of the smallest weight (cuBLAS below it, outside the PDL chain): one read per
# process, not one per projection call.
SKINNY_MIN_WEIGHT = _env_int("TANDEM_GEMV_MIN_WEIGHT", SKINNY_MIN_WEIGHT)


def prefetch_mb(after_attention: bool = False) -> float:
    """The prefetch budget of one PDL-launched GEMV: PREFETCH_MB (``TANDEM_PDL_PREFETCH_MB``). A
    projection right after attention (``after_attention``: the o projection) takes the same
    unless ``TANDEM_PDL_PREFETCH_MB_O`` sets its own: one-row decode attention is latency-bound
    and leaves HBM mostly idle for its 5-7 us, time in which the o projection's weights could
    stream into L2. Its whole weight (32 MB) made the 8B's one-row step 0.4 % faster in three
    calls, far less than an L2 filled during attention would give, and the Gemma-4 9B's plain
    and MTP steps 1.6 % and 2.1 % slower on the same machine (BENCHMARKS.md 2026-12-04
    afternoon): kept for A/Bs, not on by default. A ValueError names a variable that is not a
    number >= 0."""
    name = "TANDEM_PDL_PREFETCH_MB_O" if after_attention and os.environ.get("TANDEM_PDL_PREFETCH_MB_O") else (
        "TANDEM_PDL_PREFETCH_MB")
    raw = os.environ.get(name, "")
    try:
        mb = float(raw) if raw else PREFETCH_MB
    except ValueError:
        raise ValueError(f"{name}: expected a number, got {raw!r}") from None
    if mb < 0:
        raise ValueError(f"{name}: expected a number >= 0, got {raw!r}")
    return mb


def prefetch_cols(rows: int, splits: int, chunk: int, mb: float | None = None) -> int:
    """Weight columns per row a PDL-launched GEMV program pulls into L2 before its wait: as many
    (a power of 2, at least 16, at most the K chunk) as keep the launch's prefetch within ``mb``
    megabytes (default ``prefetch_mb()``; 0: none)."""
    mb = prefetch_mb() if mb is None else mb
    cols = int(mb * (1 << 20) / (2 * rows * splits))
    return 0 if cols < 16 else min(1 << (cols.bit_length() - 1), next_pow2(chunk))


def long_k_splits() -> int:
    """K splits for one-row projections with K > SKINNY_MAX_K (``TANDEM_GEMV_SPLITK``; 0 or 1 =
    cuBLAS there, as before split-K existed)."""
    return _env_int("TANDEM_GEMV_SPLITK", 4)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; off CUDA (the CPU twin under the interpreter) the
    H200's 132, so the CPU takes the launch decisions the H200 would."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fill_per_sm() -> int:
    """Programs per SM a narrow short-K launch is split into (``TANDEM_GEMV_FILL``; 0: never)."""
    return _env_int("TANDEM_GEMV_FILL", FILL_PER_SM)


def short_k_splits(tiles: int, k: int, block_k: int, device: torch.device) -> int:
    """K splits for a projection with K <= SKINNY_MAX_K whose launch has ``tiles`` column tiles:
    none while there are at least as many tiles as SMs, else enough that tiles x splits reaches
    ``fill_per_sm()`` programs per SM, each split at least MIN_SPLIT_TILES K tiles long.

    Why (the MTP step on the H200, h200-2026-12-04f ``trace_mtp.json.gz``, Gemma-4 9B + assistant,
    one request; medians of each projection's own time): the assistant's one-row o projection (8
    MB, 128 tiles of 8 rows on 132 SMs) took 7.5 us where its q projection, as many bytes in 512
    tiles, took 3.3; the full layer's o (16 MB, 128 tiles) 13.9 us; the 4-row verify's o (31.5
    MB, 120 tensor-core tiles) 17.0 us, at 1.9 TB/s, where its qkv (63 MB, 256 tiles) streamed
    at 3.85. Four splits give those launches
    the programs, and the bytes per program, of the fast ones. Also narrow: Qwen3-0.6B's o and
    down (1024 outputs). Launches of 132 tiles and more are untouched (Llama-8B's and the Gemma
    target's one-row projections: 480-3584). ``TANDEM_GEMV_SPLITK_SHORT=N`` forces N splits
    everywhere (1: never)."""
    forced = _env_int("TANDEM_GEMV_SPLITK_SHORT", 0)
    if forced:
        return forced
    sms, per_sm = sm_count(device), fill_per_sm()
    if not per_sm or tiles >= sms:
        return 1
    return max(1, min(-(-per_sm * sms // tiles), k // (MIN_SPLIT_TILES * block_k)))


def launch_tiles(rows: int, cfg: dict, gated: bool = False) -> int:
    """Column tiles of a GEMV launch through a weight of ``rows`` rows (``gemv``'s grid.x):
    gated, the FMA kernel holds ``block_n`` outputs (2 x block_n weight rows) a program and the
    tensor-core one ``block_n`` / 2 outputs (``block_n`` rows)."""
    per = cfg["block_n"] if not gated or cfg.get("dot") else 2 * cfg["block_n"]
    return -(-rows // per)


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


def gemv(x: torch.Tensor, w: torch.Tensor, *, act: str | None = None, splits: int = 1, block_n: int = 16,
         block_k: int = 512, num_warps: int = 4, num_stages: int = 3, prefetch_k: int | None = None,
         dot: bool = False, after_attention: bool = False) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_M, unit column stride), w [N, K] contiguous -> [M, N].

    With ``act``, w is a merged [gate; up] weight [2N, K] and the result ``act(x @ gate^T) *
    (x @ up^T)`` [M, N]. ``splits`` > 1 cuts K into that many pieces (one kernel, deterministic
    sum). ``dot`` takes the tensor-core variant (up to DOT_MAX_M rows; with ``act`` a program
    holds ``block_n`` / 2 gate rows and their up rows).
    ``after_attention``: the PDL prefetch budget of a projection right after attention
    (``prefetch_mb``); ``prefetch_k`` overrides ``prefetch_cols`` (benchmarks)."""
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
    if on != PDL_ON:
        pre = 0
    else:
        pre = prefetch_cols(rows, splits, chunk, prefetch_mb(after_attention)) if prefetch_k is None else prefetch_k
    if dot:
        mp = max(DOT_ROWS, next_pow2(m))
        rt = m > GEMV_MAX_M and splits == 1  # one variant per MP for decode batches (no compile per size)
        _gemv_dot_kernel[(tiles, splits)](
            x, w, y, ws, tk, n, k, chunk, x.stride(0), w.stride(0), y.stride(0), m, M=mp if rt else m, MP=mp,
            BLOCK_N=block_n, BLOCK_K=block_k, ACT=ACTS[act] if act else -1, SPLITS=splits, ROWS_RT=rt,
            F32=not x.is_cuda, PDL=on, PREFETCH_K=pre, num_warps=num_warps, num_stages=num_stages,
            launch_pdl=on == PDL_ON,
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


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
           after_attention: bool = False) -> torch.Tensor:
    """F.linear, or the GEMV where it measured faster: up to ``skinny_rows()`` rows through a
    mid-sized weight, split-K past SKINNY_MAX_K. Decode batches (16-256 rows) stay with cuBLAS:
    a Triton small-M GEMM (M x N tiles, split K) measured slower there on the H200
    (BENCHMARKS.md, 2026-12-02 night). ``after_attention``: see ``prefetch_mb``."""
    cfg = launch_config(x.shape[0], w) if bias is None and _skinny(x, w) else None
    if cfg is not None:
        if w.shape[1] <= SKINNY_MAX_K:
            splits = short_k_splits(launch_tiles(w.shape[0], cfg), w.shape[1], cfg["block_k"], x.device)
            return gemv(x, w, splits=splits, after_attention=after_attention, **cfg)
        splits = long_k_splits()
        if splits > 1:
            return gemv(x, w, splits=splits, after_attention=after_attention, **cfg)
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
    k = gate_up.shape[1]
    if k > SKINNY_MAX_K and long_k_splits() <= 1:
        return None  # cuBLAS there, as ``linear``
    cfg = launch_config(x.shape[0], gate_up)
    if cfg is None or not cfg.get("dot"):
        if not (mode == "1" and x.shape[0] == 1 and k <= SKINNY_MAX_K):
            return None
        cfg = gated_config()
    splits = (short_k_splits(launch_tiles(gate_up.shape[0], cfg, gated=True), k, cfg["block_k"], x.device)
              if k <= SKINNY_MAX_K else long_k_splits())
    return gemv(x, gate_up, act=act, splits=splits, **cfg)
