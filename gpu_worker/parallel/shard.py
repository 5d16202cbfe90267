"""How a tensor dimension is split across ranks, in checkpoint coordinates.

Attention is split by heads: rank r holds query heads [r*H/tp, (r+1)*H/tp) and the KV heads
those queries read. With at least as many KV heads as ranks each rank holds kv/tp of them;
with fewer (tp % kv == 0) each KV head is replicated on tp/kv consecutive ranks, so rank r
holds head r*kv//tp. Either way local query head i reads local KV head i // (H/kv), the same
grouping as the full model: attention never crosses ranks. The Gemma 4 assistant, whose
layers read the target's KV, splits its query heads by this same rule so each rank's draft
reads only that rank's KV.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.parallel.state import tp_rank, tp_size


@dataclass(frozen=True)
class Rows:
    """This rank's slice [start, start + size) of a dimension of ``full`` entries."""

    start: int
    size: int
    full: int

    @staticmethod
    def whole(n: int) -> "Rows":
        return Rows(0, n, n)


def _divisible(n: int, what: str) -> int:
    tp = tp_size()
    if n % tp:
        raise ValueError(f"--tp-size {tp}: {what} ({n}) is not divisible by it")
    return n // tp


def even(n: int, what: str) -> Rows:
    size = _divisible(n, what)
    return Rows(tp_rank() * size, size, n)


def heads(num_heads: int, head_dim: int, what: str = "attention heads") -> Rows:
    per = _divisible(num_heads, what)
    return Rows(tp_rank() * per * head_dim, per * head_dim, num_heads * head_dim)


def local_kv_heads(num_kv_heads: int) -> int:
    tp = tp_size()
    if num_kv_heads >= tp:
        return _divisible(num_kv_heads, "KV heads")
    if tp % num_kv_heads:
        raise ValueError(f"--tp-size {tp}: {num_kv_heads} KV heads can be neither split nor replicated evenly")
    return 1


def kv_heads(num_kv_heads: int, head_dim: int) -> Rows:
    tp, per = tp_size(), local_kv_heads(num_kv_heads)
    first = tp_rank() * per if num_kv_heads >= tp else tp_rank() * num_kv_heads // tp
    return Rows(first * head_dim, per * head_dim, num_kv_heads * head_dim)


def vocab(vocab_size: int) -> Rows:
    """Vocabulary rows of this rank: padded up to a multiple of tp; the last rank's tail rows
    past ``vocab_size`` are zero and cut from the gathered logits."""
    tp = tp_size()
    per = -(-vocab_size // tp)
    return Rows(tp_rank() * per, per, vocab_size)
