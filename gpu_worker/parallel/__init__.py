"""Tensor parallelism: process groups (``state``), shard arithmetic (``shard``), collectives
(``comm``), parallel layers (``layers``) and the constructors model files use (``factory``)."""

from gpu_worker.parallel.state import (
    agree_min,
    all_gather_object,
    destroy_tp,
    init_tp,
    rank_device,
    tp_rank,
    tp_size,
)

__all__ = ["agree_min", "all_gather_object", "destroy_tp", "init_tp", "rank_device", "tp_rank", "tp_size"]
