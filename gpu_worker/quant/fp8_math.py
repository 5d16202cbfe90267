"""FP8 arithmetic in torch: quantizing weights at load, dequantizing them, and the activation
quantization every FP8 path shares. The CPU twin computes with these, and the kernel tests take
them as the reference.

Invariants the kernels keep too:
- a weight is float8 e4m3 [N, K] with float32 scales [ceil(N / rows), KB]: ``rows`` output rows
  share a scale row (1, or 128 where a block layout's rows allow), and KB is 1 (one scale per
  row) or ceil(K / 128) (one per 128 columns);
- a dynamic activation scale covers one token's 128 consecutive columns: ``amax / 448``, and the
  quantized value is ``clamp(x * (448 / amax))`` rounded to nearest e4m3 (a row never depends on
  the others, so a token's result is the same in any batch);
- products of e4m3 values are exact in float32: every path sums the same products, only the
  order of the float32 sums differs.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels.fp8_round import BLOCK, FP8, FP8_MAX

MIN_AMAX = 1e-12  # an all-zero group gets this amax: a finite scale, zeros stay zeros (the kernels' too)


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448, correctly rounded as the kernels' ``div_rn`` (torch's division by a Python
    scalar multiplies by its reciprocal on CUDA: an ulp off for some values)."""
    return amax / torch.full_like(amax, FP8_MAX)


def fp8_inverse(amax: torch.Tensor) -> torch.Tensor:
    """448 / amax, correctly rounded as the kernels' ``div_rn`` (torch's ``448.0 / t`` multiplies
    by a reciprocal: a last-bit difference that can flip a rounding tie)."""
    return torch.full_like(amax, FP8_MAX) / amax


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """float32 values already divided by their scale -> e4m3, saturated (never NaN)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online FP8: w [N, K] -> (e4m3 [N, K], float32 scales [N, 1]), one scale per output row."""
    w32 = w.float()
    amax = w32.abs().amax(dim=1, keepdim=True).clamp_min(MIN_AMAX)
    return to_fp8(w32 * fp8_inverse(amax)), fp8_scale(amax)


def expand_scale(scale: torch.Tensor, rows: int, n: int, k: int) -> torch.Tensor:
    """Scales [ceil(N / rows), KB] -> one per weight element [N, K] (float32)."""
    s = scale.float().repeat_interleave(rows, dim=0)[:n]
    if s.shape[1] == 1:
        return s.expand(n, k)
    return s.repeat_interleave(BLOCK, dim=1)[:, :k]


def per_row_scale(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A checkpoint scale (per tensor, per row [R] / [R, 1], or per 128 x 128 block) -> float32
    [rows, 1] or [rows, ceil(cols / 128)]."""
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(rows, 1).contiguous()
    if s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1 and s.shape[0] == rows):
        return s.reshape(rows, 1)
    want = (-(-rows // BLOCK), -(-cols // BLOCK))
    if tuple(s.shape) != want:
        raise ValueError(f"scale of shape {tuple(s.shape)} fits neither a tensor, {rows} rows nor "
                         f"{want[0]}x{want[1]} blocks of {BLOCK}")
    return s.repeat_interleave(BLOCK, dim=0)[:rows].contiguous()


def dequantize(w8: torch.Tensor, scale: torch.Tensor, rows: int = 1) -> torch.Tensor:
    """e4m3 [N, K] with its scales -> float32 [N, K]."""
    n, k = w8.shape
    return w8.float() * expand_scale(scale, rows, n, k)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K/128)])."""
    m, k = x.shape
    kb = -(-k // BLOCK)
    xf = torch.nn.functional.pad(x.float(), (0, kb * BLOCK - k)).view(m, kb, BLOCK)
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(MIN_AMAX)
    q = to_fp8(xf * fp8_inverse(amax)).view(m, kb * BLOCK)[:, :k]
    return q, fp8_scale(amax).view(m, kb)


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Static activation quantization: x [M, K] -> e4m3 [M, K] with the one calibrated scale."""
    return to_fp8(x.float() * (1.0 / input_scale.float()))


def qdq_acts(x: torch.Tensor, acts: str, input_scale: torch.Tensor | None) -> torch.Tensor:
    """The float32 activations an FP8 linear multiplies: x itself (weight-only) or the values
    its quantization keeps."""
    if acts == "none":
        return x.float()
    if acts == "static":
        return quantize_static(x, input_scale).float() * input_scale.float()
    q, s = quantize_groups(x)
    return q.float() * expand_scale(s, 1, x.shape[0], x.shape[1])


def fp8_linear_ref(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, rows: int, acts: str,
                   input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] through an FP8 weight, in x's dtype. Weight-only: F.linear on the
    dequantized weight in x's dtype (HF run on the dequantized checkpoint); with activation
    quantization: float32 products of the quantized values."""
    w = dequantize(w8, scale, rows)
    if acts == "none":
        return torch.nn.functional.linear(x, w.to(x.dtype))
    return torch.nn.functional.linear(qdq_acts(x, acts, input_scale), w).to(x.dtype)
