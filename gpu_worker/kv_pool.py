"""The paged KV pool: one K and one V tensor per KV-owning layer, each with its own shape.

Addressing is token-level: ``loc = page * page_size + offset``. Page 0 is never handed to a
request; padding rows write there and masked reads may land there. Gemma 4 layers of different
types keep their own (kv_heads, head_dim); layers that share another layer's KV own no tensor.

Who frees a page: the scheduler (scheduler_proc/pages.py) owns the free list; the worker only
reads and writes the pages named in a slot's page table.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch


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
    def __init__(self, shapes: list[KVLayerShape], num_pages: int, page_size: int, dtype, device):
        self.shapes = shapes
        self.num_pages = num_pages  # includes page 0 (padding)
        self.page_size = page_size
        n = num_pages * page_size
        self.k = [_zeros((n, s.num_kv_heads, s.head_dim), dtype, device) for s in shapes]
        self.v = [_zeros((n, s.num_kv_heads, s.v_dim), dtype, device) for s in shapes]

    @staticmethod
    def bytes_per_token(shapes: list[KVLayerShape], dtype) -> int:
        elt = torch.empty((), dtype=dtype).element_size()
        return sum(s.num_kv_heads * (s.head_dim + s.v_dim) * elt for s in shapes)

    def write(self, kv_layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[kv_layer].index_copy_(0, loc, k.to(self.k[kv_layer].dtype))
        self.v[kv_layer].index_copy_(0, loc, v.to(self.v[kv_layer].dtype))
