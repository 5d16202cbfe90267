"""FP8 weight kernels against ``quant/fp8_math`` (the torch arithmetic the CPU twin runs):
the activation quantization bit for bit, the one-row GEMV (split-K) and the GEMM in every weight
layout and activation scheme within a rounding of the exact products.
Under CI they run in Triton's interpreter at small shapes; tests/gpu repeats them at real ones."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels import tickets_clear
from gpu_worker.kernels.fp8_gemm import fp8_gemm
from gpu_worker.kernels.fp8_gemv import fp8_gemv_dot, fp8_gemv_row
from gpu_worker.kernels.fp8_linear import fp8_linear
from gpu_worker.kernels.fp8_quant import quantize_acts
from gpu_worker.quant.fp8_math import BLOCK, FP8_MAX, dequantize, fp8_linear_ref, quantize_groups, quantize_rows
from tests.unit.kernel_refs import INPUT_SCALE, fp8_weight

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
ACTS = ["none", "dynamic", "static"]


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (torch.rand(m, 1, generator=g) * 4 + 0.1)
    x[:, :7] *= 20  # an outlier group: per-group scales must keep the other groups fine
    return x.to(torch.bfloat16).to(DEV)




def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Within a bf16 rounding of the exact sums (plus float32 reordering)."""
    ref = ref.float().cpu()
    y = y.float().cpu()
    tol = ref.abs() * 2.0**-7 + 1e-3 * ref.abs().max()
    assert ((y - ref).abs() <= tol).all(), ((y - ref).abs() - tol).max()


def _ref(x, w8, s, rows, acts):
    """The exact products of what the kernels multiply, in float64, rounded once to bf16."""
    inp = INPUT_SCALE.to(DEV) if acts == "static" else None
    from gpu_worker.quant.fp8_math import qdq_acts

    xv = qdq_acts(x, acts, inp).double()
    return (xv @ dequantize(w8, s, rows).double().t()).to(torch.bfloat16)


@pytest.mark.parametrize("m,k", [(1, 300), (3, 256), (17, 384)])
def test_activation_quantization_is_bitwise_the_reference(m, k):
    x = _x(m, k)
    q, s = quantize_acts(x)
    rq, rs = quantize_groups(x.cpu())
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)
    q, s = quantize_acts(x, INPUT_SCALE.to(DEV))
    from gpu_worker.quant.fp8_math import quantize_static

    assert torch.equal(q.cpu().view(torch.uint8), quantize_static(x.cpu(), INPUT_SCALE).view(torch.uint8))


@pytest.mark.parametrize("acts", ACTS)
@pytest.mark.parametrize("layout,rows", [("channel", 1), ("block", 1), ("block", BLOCK)])
@pytest.mark.parametrize("groups,splits", [(1, 1), (2, 1), (2, 2), (1, 3)])
def test_fp8_row_gemv(groups, splits, layout, rows, acts):
    """The one-row kernel: K tiles of one and two scale groups, split-K."""
    n, k = 160, 580  # a partial last K tile and group, a partial last 128-row block
    w8, s, sr = fp8_weight(n, k, layout, seed=groups + splits, rows=rows)
    x = _x(1, k, seed=splits)
    inp = INPUT_SCALE.to(DEV) if acts == "static" else None
    cfg = dict(block_n=16, groups=groups, num_warps=4, num_stages=2)
    y = fp8_gemv_row(x, w8, s, sr, {"none": 0, "dynamic": 1, "static": 2}[acts], inp, splits=splits, cfg=cfg)
    _close(y, _ref(x, w8, s, sr, acts))
    assert tickets_clear()


@pytest.mark.parametrize("acts", ACTS)
@pytest.mark.parametrize("layout,rows", [("channel", 1), ("block", 1), ("block", BLOCK)])
@pytest.mark.parametrize("m,splits", [(1, 1), (1, 3), (2, 2), (4, 1)])
def test_fp8_tensor_core_gemv(m, splits, layout, rows, acts):
    """The tensor-core GEMV at one to four rows: x padded to 16 rows and quantized a tile at a
    time, split-K, a partial last K tile and row tile."""
    n, k = 80, 580
    w8, s, sr = fp8_weight(n, k, layout, seed=m + splits, rows=rows)
    x = _x(m, k, seed=splits)
    inp = INPUT_SCALE.to(DEV) if acts == "static" else None
    y = fp8_gemv_dot(x, w8, s, sr, {"none": 0, "dynamic": 1, "static": 2}[acts], inp, splits=splits,
                     cfg=dict(block_n=32, num_warps=4, num_stages=2))
    _close(y, _ref(x, w8, s, sr, acts))
    assert tickets_clear()


@pytest.mark.parametrize("acts", ["dynamic", "static"])
@pytest.mark.parametrize("layout,rows", [("channel", 1), ("block", BLOCK)])
@pytest.mark.parametrize("m,splits", [(1, 1), (1, 3), (4, 2)])
def test_fp8_gated_gemv_is_the_projection_then_the_activation(m, splits, layout, rows, acts):
    """gate_up with the activation in the tensor-core GEMV's epilogue: the projection rounded to
    the model dtype, then the activation kernel's roundings (gate rows and up rows in one tile,
    split-K)."""
    from gpu_worker.kernels import enable_cpu_kernels
    from gpu_worker.kernels.activation import gated_act

    n, k = 2 * 48, 580  # 48 outputs: a partial last tile of 32 rows (16 gate + 16 up)
    w8, s, sr = fp8_weight(n, k, layout, seed=m + splits, rows=rows)
    x = _x(m, k, seed=splits)
    inp = INPUT_SCALE.to(DEV) if acts == "static" else None
    a8 = {"dynamic": 1, "static": 2}[acts]
    cfg = dict(block_n=32, num_warps=4, num_stages=2)
    y = fp8_gemv_dot(x, w8, s, sr, a8, inp, splits=splits, cfg=cfg, act="silu")
    gate, up = fp8_gemv_dot(x, w8, s, sr, a8, inp, splits=splits, cfg=cfg).split(n // 2, dim=1)
    enable_cpu_kernels(True)
    try:
        assert torch.equal(y, gated_act(gate, up, "silu"))
    finally:
        enable_cpu_kernels(False)
    assert tickets_clear()


@pytest.mark.parametrize("acts", ACTS)
@pytest.mark.parametrize("layout,rows", [("channel", 1), ("block", BLOCK)])
@pytest.mark.parametrize("m", [5, 40])
def test_fp8_gemm(m, layout, rows, acts):
    n, k = 96, 384
    w8, s, sr = fp8_weight(n, k, layout, seed=m, rows=rows)
    x = _x(m, k, seed=m)
    inp = INPUT_SCALE.to(DEV) if acts == "static" else None
    cfg = dict(block_m=16, block_n=32, num_warps=4, num_stages=2)
    if acts == "none":
        y = fp8_gemm(x, None, w8, s, sr, x.dtype, cfg=cfg)
    else:
        xq, xs = quantize_acts(x, inp)
        y = fp8_gemm(xq, xs, w8, s, sr, x.dtype, static=acts == "static", cfg=cfg)
    _close(y, _ref(x, w8, s, sr, acts))


@pytest.mark.parametrize("acts", ACTS)
@pytest.mark.parametrize("layout,rows", [("channel", 1), ("block", BLOCK)])
@pytest.mark.parametrize("splits", [2, 3])
def test_fp8_gemm_split_k(splits, layout, rows, acts):
    """K in uneven chunks (5 K tiles: 3 + 2, 2 + 2 + 1), partial tiles on both edges: the last
    program of each tile sums the partials, and every ticket is back at 0 after."""
    m, n, k = 21, 80, 5 * BLOCK - 40
    w8, s, sr = fp8_weight(n, k, layout, seed=splits, rows=rows)
    x = _x(m, k, seed=splits)
    inp = INPUT_SCALE.to(DEV) if acts == "static" else None
    cfg = dict(block_m=16, block_n=32, num_warps=4, num_stages=2)
    if acts == "none":
        y = fp8_gemm(x, None, w8, s, sr, x.dtype, cfg=cfg, splits=splits)
    else:
        xq, xs = quantize_acts(x, inp)
        y = fp8_gemm(xq, xs, w8, s, sr, x.dtype, static=acts == "static", cfg=cfg, splits=splits)
    _close(y, _ref(x, w8, s, sr, acts))
    assert tickets_clear()


def test_fp8_gemm_splits_narrow_launches_only():
    """The launch rule: as many tiles as SMs, no split; a narrow launch splits K until it fills the
    SMs, each chunk at least SPLIT_MIN_TILES K tiles."""
    from gpu_worker.kernels.fp8_gemm import SPLIT_FILL, SPLIT_MIN_TILES, gemm_splits
    from gpu_worker.kernels.gemv import sm_count

    cpu = torch.device("cpu")
    sms = sm_count(cpu)
    assert gemm_splits(sms, 1 << 16, cpu) == 1
    assert gemm_splits(sms // 2, 1 << 16, cpu) == 2 * SPLIT_FILL
    assert gemm_splits(1, SPLIT_MIN_TILES * BLOCK, cpu) == 1
    assert gemm_splits(1, 3 * SPLIT_MIN_TILES * BLOCK, cpu) == 3


@pytest.mark.parametrize("acts", ACTS)
@pytest.mark.parametrize("m", [1, 3, 9])
def test_dispatch_agrees_with_the_cpu_twin(m, acts):
    """``fp8_linear`` (whichever kernel the row count takes) and ``fp8_linear_ref`` (the CPU
    twin's torch path) compute the same products: one bf16 rounding apart."""
    w8, s, sr = fp8_weight(64, 256, "block", seed=3, rows=1)
    x = _x(m, 256)
    inp = INPUT_SCALE.to(DEV) if acts == "static" else None
    _close(fp8_linear(x, w8, s, sr, acts, inp), fp8_linear_ref(x.float(), w8, s, sr, acts, inp))
