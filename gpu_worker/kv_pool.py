"""The paged KV pool: one K and one V tensor per KV-owning layer, each with its own shape.

Addressing is token-level: ``loc = page * page_size + offset``. Page 0 is never handed to a
request; padding rows write there and masked reads may land there. Gemma 4 layers of different
types keep their own (kv_heads, head_dim); layers that share another layer's KV own no tensor.

FP8 (``--kv-cache-dtype fp8_e4m3``): the tensors hold float8 e4m3, one byte an element, so the
same memory holds twice the tokens. Each pool layer has a k and a v scale (the checkpoint's
calibrated ones, else 1.0): a key is stored as ``clamp(k * (1 / k_scale))`` rounded to e4m3
(saturating, never NaN) and read back as ``stored * k_scale``. Every writer (``write``, the
RoPE + store kernels) and every reader (the backends' kernels, the torch backend) keeps that
convention; readers fold ``k_scale`` into the softmax scale and ``v_scale`` into the output.

Who frees a page: the scheduler (scheduler_proc/pages.py) owns the free list; the worker only
reads and writes the pages named in a slot's page table.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from gpu_worker.kernels.fp8_round import FP8 as FP8_KV
from gpu_worker.kernels.fp8_round import FP8_MAX
KV_DTYPES = {"fp8_e4m3": FP8_KV}  # --kv-cache-dtype, past auto (the model dtype)


def kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's storage dtype for ``--kv-cache-dtype``."""
    return model_dtype if name == "auto" else KV_DTYPES[name]


@dataclass(frozen=True)
class KVLayerShape:
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None  # defaults to head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim


def _zeros(shape: tuple[int, ...], dtype, device) -> torch.Tensor:
    """Zeros. On the CPU, anonymous memory: the OS's shared zero page until a page is written, so
    the pool's resident size follows the KV written, not its capacity."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


class KVPool:
    def __init__(self, shapes: list[KVLayerShape], num_pages: int, page_size: int, dtype, device,
                 scales: dict[int, tuple[float, float]] | None = None):
        """``dtype``: the storage dtype; ``scales``: pool layer -> (k scale, v scale) for an FP8
        pool (missing layers: 1.0)."""
        self.shapes = shapes
        self.num_pages = num_pages  # includes page 0 (padding)
        self.page_size = page_size
        self.dtype = dtype
        self.fp8 = dtype == FP8_KV
        scales = scales or {}
        self.k_scale = [float(scales.get(i, (1.0, 1.0))[0]) if self.fp8 else 1.0 for i in range(len(shapes))]
        self.v_scale = [float(scales.get(i, (1.0, 1.0))[1]) if self.fp8 else 1.0 for i in range(len(shapes))]
        n = num_pages * page_size
        self.k = [_zeros((n, s.num_kv_heads, s.head_dim), dtype, device) for s in shapes]
        self.v = [_zeros((n, s.num_kv_heads, s.v_dim), dtype, device) for s in shapes]

    @staticmethod
    def bytes_per_token(shapes: list[KVLayerShape], dtype) -> int:
        elt = torch.empty((), dtype=dtype).element_size()
        return sum(s.num_kv_heads * (s.head_dim + s.v_dim) * elt for s in shapes)

    def store_scales(self, kv_layer: int) -> tuple[float, float]:
        """(1 / k_scale, 1 / v_scale): what a writer multiplies by before rounding to e4m3."""
        return 1.0 / self.k_scale[kv_layer], 1.0 / self.v_scale[kv_layer]

    def _stored(self, x: torch.Tensor, inv: float, dst: torch.Tensor) -> torch.Tensor:
        if not self.fp8:
            return x.to(dst.dtype)
        return (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV)

    def write(self, kv_layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        kc, vc = self.k[kv_layer], self.v[kv_layer]
        ki, vi = self.store_scales(kv_layer)
        k, v = self._stored(k, ki, kc), self._stored(v, vi, vc)
        if self.fp8:  # index_copy_ has no float8 kernel: copy the bytes
            kc, vc, k, v = kc.view(torch.uint8), vc.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
        kc.index_copy_(0, loc, k)
        vc.index_copy_(0, loc, v)

    def read(self, kv_layer: int, loc: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``loc`` (any index shape) in ``dtype`` (dequantized when FP8)."""
        k, v = self.k[kv_layer][loc], self.v[kv_layer][loc]
        if not self.fp8:
            return k.to(dtype), v.to(dtype)
        return (k.float() * self.k_scale[kv_layer]).to(dtype), (v.float() * self.v_scale[kv_layer]).to(dtype)
