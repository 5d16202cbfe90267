"""The attention-backend contract.

A backend is built once per worker over the KV pool and the page table, then per forward:
``meta = backend.build(layout)`` (all index/mask work, once) and per layer
``backend.forward(layer, q, k, v, fb)``. ``k``/``v`` None means a Q-only read of another
layer's KV (Gemma 4 KV sharing, the frozen-KV draft).

Mask rule, one for every caller: the query token t of row b sees key j iff
``j < kv_lens[b]`` and ``j <= q_pos[t]`` and, on a sliding layer, ``j > q_pos[t] - window``.
The frozen-KV draft passes ``q_pos = kv_len - 1`` so it sees exactly the committed prefix
(its last ``window`` keys on sliding layers), whatever its RoPE position is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.forward_batch import AttnLayer, ForwardBatch
from gpu_worker.kv_pool import KVPool


@dataclass
class RowLayout:
    slots: torch.Tensor  # [B] int64 on device
    q_lens: np.ndarray  # [B] host: query tokens per row (tokens are row-contiguous)
    kv_lens: torch.Tensor  # [B] int64 on device: keys visible to the row
    kv_bound: np.ndarray  # [B] host: an upper bound of kv_lens (sizes the gather, no sync)
    q_pos: torch.Tensor  # [T] int64 on device: mask position of each query token
    slots_host: np.ndarray | None = None  # [B] the slots on the host, where the caller has them
    kv_exact: np.ndarray | None = None  # [B] kv_lens on the host, where the host knows them exactly


class AttentionBackend(ABC):
    def __init__(self, pool: KVPool, page_table: torch.Tensor):
        self.pool = pool
        self.page_table = page_table  # [slots + 1, max_pages] int32, row 0 = padding

    # Set by the runner: True when the host knows every decode row's KV length exactly (no MTP:
    # each step adds one token). Backends whose plan needs host lengths use it for decode rows.
    host_decode_lens: bool = False
    # Set by the runner: the query counts of the engine's decode rows ({1} plain, {1, S+1} with
    # MTP); only a tail of rows with one of them is a decode group (attention/triton_backend.py).
    decode_q_lens: frozenset = frozenset({1})

    def stage(self, q_lens: np.ndarray, slots: np.ndarray | None = None,
              kv_exact: np.ndarray | None = None) -> object | None:
        """Host-built metadata for a forward with these query counts (and, where known, its
        slots and exact KV lengths): a staged dataclass (``gpu_worker/upload.py``) that the step's one
        upload sends to the device before ``build`` reads it. Default: none."""
        return None

    def stage_graph(self, bucket: int, slots: np.ndarray, kv_exact: np.ndarray | None) -> object | None:
        """Likewise before a step that replays the decode graph of ``bucket`` for these rows
        (their exact KV lengths, or None). Default: none (graphs read device state)."""
        return None

    def prepare_graph(self, bucket: int, staged) -> None:
        """After the upload, before that replay, with ``stage_graph``'s uploaded result:
        plan-style host work. Default: nothing."""

    @abstractmethod
    def build(self, layout: RowLayout, windows: tuple[int, ...], staged=None) -> object:
        """Per-forward metadata; ``windows`` lists the sliding windows the model uses;
        ``staged`` is ``stage``'s uploaded result (None: build it all here)."""

    @abstractmethod
    def forward(
        self,
        layer: AttnLayer,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        fb: ForwardBatch,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D] -> [T, Hq, Dv] (into ``out`` when given: the piecewise prefill graphs'
        static buffer); writes k/v at fb.out_loc first when given."""
