"""What one model forward needs: flat tokens plus backend-built attention metadata.

Rows are requests; tokens are laid out row after row ("varlen"). Each row attends over the
keys [0, kv_len) of its slot's pages. Two mask conventions (chosen when the metadata is built):

- target (extend / decode / verify): a query at position p sees keys j <= p, and on sliding
  layers only j > p - window;
- frozen-KV draft: queries write nothing and see exactly the committed keys [0, kv_len); on
  sliding layers the last ``window`` of them. RoPE positions are separate from mask positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor | None  # [T] int64; None when the caller passes embeddings
    positions: torch.Tensor  # [T] int64, RoPE positions
    out_loc: torch.Tensor | None  # [T] int64 KV write locations; None for Q-only (draft) forwards
    attn: Any  # backend metadata, built once per forward and shared by every layer
    num_tokens: int
    rope_cache: dict = field(default_factory=dict)  # reference path: cos/sin per RoPE kind
    scratch: Any = None  # piecewise prefill graphs: static buffers for rotated q (prefill_graphs.py)

    @property
    def writes_kv(self) -> bool:
        return self.out_loc is not None


@dataclass(frozen=True)
class AttnLayer:
    """How one attention layer reads and writes the pool."""

    kv_layer: int  # index into KVPool.k / .v (the physical KV owner)
    sliding_window: int | None  # HF semantics: keys with p - window < j <= p
    scaling: float
    writes_kv: bool = True  # False: reads another layer's KV (Gemma 4 KV sharing, MTP draft)
    logit_softcap: float | None = None
