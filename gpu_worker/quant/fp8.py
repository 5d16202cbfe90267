"""The FP8 linear method: what a quantized projection holds and how it multiplies.

A quantized projection (``Linear``, ``MergedLinear`` and the tensor-parallel linears, all with
``quantizable = True``) keeps its module and its HF name; ``create`` swaps its ``weight`` for
float8 e4m3 and adds

- ``weight_scale``: float32 [ceil(N / scale_rows), KB] (``fp8_math``'s layout; ``scale_rows`` 1
  while loading, 128 after ``finish`` where every 128-row group of a block layout shares its
  scales);
- ``input_scale``: float32 [1], static activation formats only (merged parts: the largest);
- ``quant``: this method, which its ``forward`` hands the multiplication to.

``apply`` takes the kernels on the device path (``kernels/fp8_linear.py``: a GEMV for 1-4 rows,
the FP8 GEMM above) and ``fp8_math`` on the CPU twin; ``gated`` runs a merged gate_up with its
activation in one kernel where the GEMV takes x. A MoE layer's experts are FP8 through their
own method (``fp8_experts.py``: e4m3 stacks the expert kernels read as e4m3).
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.kernels import use_triton
from gpu_worker.kernels.fp8_linear import A8, fp8_gated_linear, fp8_linear
from gpu_worker.quant.config import Fp8Format
from gpu_worker.quant.fp8_math import BLOCK, FP8, fp8_linear_ref, quantize_rows


class Fp8LinearMethod:
    def __init__(self, fmt: Fp8Format):
        self.fmt = fmt

    def create(self, layer: nn.Module) -> None:
        """Make ``layer`` (on the meta device, already cast to the model dtype) an FP8 projection."""
        n, k = layer.weight.shape
        dev = layer.weight.device
        layer.weight = nn.Parameter(torch.empty(n, k, dtype=FP8, device=dev), requires_grad=False)
        kb = 1 if self.fmt.weights == "channel" else -(-k // BLOCK)
        layer.register_buffer("weight_scale", torch.empty(n, kb, dtype=torch.float32, device=dev), persistent=False)
        if self.fmt.acts == "static":
            layer.register_buffer("input_scale", torch.zeros(1, dtype=torch.float32, device=dev), persistent=False)
        layer.scale_rows = 1
        layer.quant = self

    def finish(self, layer: nn.Module) -> None:
        """After loading: block scales shared by each 128-row group are kept once per group
        (the GEMV then reads N / 128 scale rows instead of N)."""
        s = layer.weight_scale
        if self.fmt.weights != "block" or s.shape[0] % BLOCK or layer.scale_rows != 1:
            return
        grouped = s.view(-1, BLOCK, s.shape[1])
        if torch.equal(grouped, grouped[:, :1].expand_as(grouped)):
            layer.weight_scale = grouped[:, 0].contiguous()
            layer.scale_rows = BLOCK

    def quantize_into(self, layer: nn.Module, rows: slice, w: torch.Tensor) -> None:
        """Online FP8: an unquantized checkpoint tensor [rows, K] -> its rows of the layer."""
        w8, s = quantize_rows(w.to(layer.weight.device))
        layer.weight.data[rows].copy_(w8)
        layer.weight_scale.data[rows].copy_(s)

    def init_dummy(self, layer: nn.Module, gen: torch.Generator) -> None:
        """``--load-format dummy``: random weights (std 0.02, as ``CausalLM.init_dummy_``),
        quantized a slice of rows at a time (no full-precision copy of a whole weight)."""
        n, k = layer.weight.shape
        step = max(1, (64 << 20) // (4 * k))
        for r in range(0, n, step):
            w = torch.empty(min(step, n - r), k, device=layer.weight.device).normal_(0.0, 0.02, generator=gen)
            self.quantize_into(layer, slice(r, r + w.shape[0]), w)
        if self.fmt.acts == "static":
            layer.input_scale.data.fill_(1.0 / 448)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        x2 = x.reshape(-1, x.shape[-1])
        inp = getattr(layer, "input_scale", None)
        if use_triton(x2):
            y = fp8_linear(x2, layer.weight, layer.weight_scale, layer.scale_rows, self.fmt.acts, inp)
        else:
            y = fp8_linear_ref(x2, layer.weight, layer.weight_scale, layer.scale_rows, self.fmt.acts, inp)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], y.shape[-1])

    def gated(self, layer: nn.Module, x: torch.Tensor, act: str) -> torch.Tensor | None:
        """``act(gate) * up`` of a merged [gate; up] projection in one kernel (no bias), or None
        where no such kernel takes x: the caller applies the projection, then the activation."""
        if x.dim() != 2 or not use_triton(x):
            return None
        return fp8_gated_linear(x, layer.weight, layer.weight_scale, layer.scale_rows, self.fmt.acts,
                                getattr(layer, "input_scale", None), act)

    def kernel_args(self, layer: nn.Module) -> dict:
        """What a kernel taking this projection's weight needs besides it (``qkv_rope.qkv_rope_store``'s
        FP8 arguments)."""
        return dict(scale=layer.weight_scale, scale_rows=layer.scale_rows, a8=A8[self.fmt.acts],
                    input_scale=getattr(layer, "input_scale", None))
