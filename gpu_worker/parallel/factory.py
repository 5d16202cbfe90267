"""What model files call to build their projections. At TP=1 each returns exactly the plain
module the model used before (``Linear``, ``MergedLinear``, ``nn.Embedding``), so the
checkpoint key mapping and the arithmetic are unchanged; at TP>1 the parallel layer."""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.parallel.linear import Linear, MergedLinear
from gpu_worker.parallel import layers as P
from gpu_worker.parallel import shard
from gpu_worker.parallel.state import tp_size


def column(in_features: int, rows: shard.Rows, bias: bool = False) -> nn.Linear:
    if tp_size() == 1:
        return Linear(in_features, rows.full, bias=bias)
    return P.ColumnParallelLinear(in_features, rows, bias=bias)


def merged(in_features: int, parts: dict[str, shard.Rows], bias: bool = False) -> MergedLinear:
    if tp_size() == 1:
        return MergedLinear(in_features, {name: r.full for name, r in parts.items()}, bias=bias)
    return P.MergedColumnParallelLinear(in_features, parts, bias=bias)


def row(cols: shard.Rows, out_features: int, bias: bool = False) -> nn.Linear:
    if tp_size() == 1:
        return Linear(cols.full, out_features, bias=bias)
    return P.RowParallelLinear(cols, out_features, bias=bias)


def embedding(vocab_size: int, dim: int) -> nn.Module:
    if tp_size() == 1:
        return nn.Embedding(vocab_size, dim)
    return P.VocabParallelEmbedding(shard.vocab(vocab_size), dim)


def lm_head(dim: int, vocab_size: int) -> nn.Module:
    if tp_size() == 1:
        return nn.Linear(dim, vocab_size, bias=False)
    return P.ParallelLMHead(shard.vocab(vocab_size), dim)


def qkv_parts(num_heads: int, num_kv_heads: int, head_dim: int, with_v: bool = True) -> dict[str, shard.Rows]:
    """q/k(/v) rows of this rank: query heads split, KV heads split or replicated."""
    parts = {"q_proj": shard.heads(num_heads, head_dim), "k_proj": shard.kv_heads(num_kv_heads, head_dim)}
    if with_v:
        parts["v_proj"] = shard.kv_heads(num_kv_heads, head_dim)
    return parts


def gate_up_parts(intermediate: int) -> dict[str, shard.Rows]:
    rows = shard.even(intermediate, "intermediate_size")
    return {"gate_proj": rows, "up_proj": rows}


def logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary logits on every rank (identity of today's ``F.linear`` at TP=1)."""
    return P.lm_logits(hidden, weight, vocab_size)
