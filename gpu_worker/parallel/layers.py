"""Tensor-parallel layers (Megatron-style) that keep HF's parameter names.

Each layer holds only this rank's shard and knows how to cut it from the full checkpoint
tensor (``checkpoint_shard``), which the loader calls per tensor, so no rank ever
materialises another rank's weights on its device.

- ``ColumnParallelLinear``: output features split; no communication (the output stays split).
- ``MergedColumnParallelLinear``: q/k/v or gate/up in one GEMM, each part split on its own
  (``Rows`` per part: KV parts may be replicated, see ``shard.py``).
- ``RowParallelLinear``: input features split; partial sums all-reduced, then the bias once.
- ``VocabParallelEmbedding``: vocabulary rows split; out-of-shard ids give zeros, all-reduce
  sums the single non-zero contribution (exact: x + 0 = x).
- ``ParallelLMHead``: the untied head, split like the embedding; logits via ``lm_logits``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.graphs import cpu_ops
from gpu_worker.kernels.gemv import linear
from gpu_worker.parallel.linear import Linear, MergedLinear
from gpu_worker.parallel.comm import all_gather_last, all_reduce
from gpu_worker.parallel.shard import Rows
from gpu_worker.parallel.state import tp_size


def _narrow_rows(src: torch.Tensor, rows: Rows, dim: int = 0) -> torch.Tensor:
    """src's slice along ``dim``, zero-padded when the shard runs past the checkpoint's end."""
    end = min(rows.start + rows.size, src.shape[dim])
    part = src.narrow(dim, rows.start, max(end - rows.start, 0))
    if part.shape[dim] == rows.size:
        return part
    shape = list(src.shape)
    shape[dim] = rows.size - part.shape[dim]
    return torch.cat([part, src.new_zeros(shape)], dim=dim)


class ColumnParallelLinear(Linear):
    def __init__(self, in_features: int, rows: Rows, bias: bool = False):
        super().__init__(in_features, rows.size, bias=bias)
        self.rows = rows

    def checkpoint_shard(self, leaf: str, src: torch.Tensor, part: str | None = None) -> torch.Tensor:
        return _narrow_rows(src, self.rows, 0)


class MergedColumnParallelLinear(MergedLinear):
    """``MergedLinear`` over local part widths: the loader's merged-part mapping is unchanged."""

    def __init__(self, in_features: int, parts: dict[str, Rows], bias: bool = False):
        super().__init__(in_features, {name: r.size for name, r in parts.items()}, bias=bias)
        self.ranges = dict(parts)

    def checkpoint_shard(self, leaf: str, src: torch.Tensor, part: str | None = None) -> torch.Tensor:
        if part is None:
            raise KeyError("a merged projection loads per part")
        return _narrow_rows(src, self.ranges[part], 0)


class RowParallelLinear(nn.Linear):
    quantizable = True  # an FP8 projection holds ``quant`` (gpu_worker.quant), as ``Linear``
    quant = None

    def __init__(self, cols: Rows, out_features: int, bias: bool = False):
        super().__init__(cols.size, out_features, bias=bias)
        self.cols = cols

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.quant.apply(self, x) if self.quant is not None else linear(x, self.weight))
        return y + self.bias if self.bias is not None else y

    def checkpoint_shard(self, leaf: str, src: torch.Tensor, part: str | None = None) -> torch.Tensor:
        return _narrow_rows(src, self.cols, 1) if leaf == "weight" else src


class VocabParallelEmbedding(nn.Module):
    def __init__(self, rows: Rows, dim: int):
        super().__init__()
        self.rows = rows
        self.weight = nn.Parameter(torch.empty(rows.size, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.rows.start
        inside = (local >= 0) & (local < self.rows.size)
        out = F.embedding(local.clamp(0, self.rows.size - 1), self.weight)
        return all_reduce(out.masked_fill_(~inside[:, None], 0.0))

    def checkpoint_shard(self, leaf: str, src: torch.Tensor, part: str | None = None) -> torch.Tensor:
        return _narrow_rows(src, self.rows, 0)


class ParallelLMHead(VocabParallelEmbedding):
    """The untied ``lm_head.weight``, vocabulary-split; never called as an embedding."""

    def forward(self, ids):  # pragma: no cover - a head, not a lookup
        raise TypeError("ParallelLMHead: use lm_logits(hidden, head.weight, vocab)")


def lm_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """hidden [R, H] x vocabulary shard -> full logits [R, vocab_size] on every rank, gathered
    before softcap and sampling so every rank samples the same tokens from the same logits.
    Each logit is one rank's full-length dot product: no cross-rank sum, so no reordering."""
    local = F.linear(hidden, weight) if weight.dtype == hidden.dtype else cpu_ops.linear(hidden, weight)
    if tp_size() == 1:
        return local
    return all_gather_last(local)[..., :vocab_size]


def vocab_rows_logits(hidden: torch.Tensor, weight: torch.Tensor, rows: Rows, ids: torch.Tensor) -> torch.Tensor:
    """hidden [R, H] . weight row of each id in ``ids`` [R, K] -> [R, K], for a vocabulary-split
    weight: each rank scores the ids it holds, zeros elsewhere, and the all-reduce sums the one
    non-zero term per id (the assistant's centroid-masked head)."""
    local = ids - rows.start
    inside = (local >= 0) & (local < rows.size)
    emb = weight[local.clamp(0, rows.size - 1)]  # [R, K, H]
    picked = (hidden.unsqueeze(-2) @ emb.transpose(-1, -2)).squeeze(-2)
    return all_reduce(picked.masked_fill_(~inside, 0.0))
