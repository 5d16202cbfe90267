"""The plain (unsharded) linear modules every model projection is built from.

``Linear`` is ``nn.Linear`` whose small-row GEMMs may take the skinny kernel
(``kernels/gemv.py``); ``MergedLinear`` holds several projections of one input as one weight.
The tensor-parallel layers (``parallel/layers.py``) subclass them, and ``parallel/factory.py``
returns them as they are at TP=1. They live in ``parallel`` so the model files import
``parallel`` and nothing in ``parallel`` imports the model files.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.graphs import cpu_ops
from gpu_worker.kernels.gemv import linear


class Linear(nn.Linear):
    """nn.Linear whose few-row (decode) GEMMs may take the skinny kernel (kernels/gemv.py).
    ``quant``: the quantized-linear method of an FP8 projection (``gpu_worker.quant``), which
    then holds the weight and its scales and does the multiplication. A bfloat16 weight under a
    float32 x (the CPU's AMX layout, ``models/cpu_layout.py``) goes to ``graphs/cpu_ops.linear``."""

    quantizable = True
    quant = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.apply(self, x, self.bias)
        if self.weight.dtype != x.dtype:  # a bfloat16 weight under a float32 x (models/cpu_layout.py)
            out = cpu_ops.linear(x, self.weight)
            return out if self.bias is None else out + self.bias
        return linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of one input as one weight [sum(parts), in]: one GEMM instead of many
    (q/k/v, gate/up). ``parts`` maps each checkpoint projection name to its output width, in
    order; the loader copies each checkpoint tensor into its rows."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)

    def shard(self, part: str) -> tuple[int, int]:
        """(row offset, rows) of ``part`` in the merged weight."""
        offset = 0
        for name, rows in self.parts.items():
            if name == part:
                return offset, rows
            offset += rows
        raise KeyError(part)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The merged output as one column view per part (no copy)."""
        return torch.split(y, list(self.parts.values()), dim=-1)
