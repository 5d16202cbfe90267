"""Prefill-shaped forwards at start-up, before the worker reports ready.

CUDA graphs cover decode steps only; a step with a prefill chunk runs eagerly, and the first
such step of a process would meet every kernel of its shapes for the first time: cuBLAS
modules loaded lazily for large-M GEMMs, Triton variants compiled or read from disk, making the
first seconds of prefill steps many times slower in host time. A few forwards at chunk-like
sizes pay that before serving, as vLLM's and SGLang's start-up dummy runs do.

Invariant kept: the forwards touch no slot state. They run as slot 0, the padding row, whose
page-table row is all page 0, so they read and write only page 0, scratch for padding rows
already (``graphs/decode.py``).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from gpu_worker.attention.base import RowLayout
from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.kernels.argmax import argmax_last

MIN_TOKENS = 32  # smallest size warmed: the extend kernel's launch shape does not depend on it


def prefill_sizes(chunk: int, max_tokens: int) -> list[int]:
    """Token counts to warm: the largest prefill chunk, then smaller ones, which select other
    GEMM kernels; none past what one slot's page-table row addresses."""
    top = min(chunk, max_tokens)
    return sorted({n for n in (top, 2048, 256, MIN_TOKENS) if MIN_TOKENS <= n <= top}, reverse=True)


@torch.inference_mode()
def warm_prefill(runner, sizes: list[int]) -> float:
    """One eager target forward (its LM head and greedy argmax on the last token) per size;
    returns seconds. Sampling runs outside the graphs, so no capture compiles its kernels."""
    t0 = time.perf_counter()
    backend, target, dev = runner.backend, runner.target, runner.device
    ps = backend.pool.page_size
    for n in sizes:
        pos = torch.arange(n, device=dev)
        layout = RowLayout(slots=torch.zeros(1, dtype=torch.int64, device=dev), q_lens=np.array([n]),
                           kv_lens=torch.full((1,), n, dtype=torch.int64, device=dev), kv_bound=np.array([n]),
                           q_pos=pos, slots_host=np.zeros(1, dtype=np.int64), kv_exact=np.array([n]))
        ids = (pos * 7919 + 13) % target.vocab_size  # any in-vocabulary ids
        fb = ForwardBatch(ids, pos, pos % ps, backend.build(layout, runner.windows), n)  # out_loc: page 0
        argmax_last(target.compute_logits(target.forward(fb, backend)[-1:]))  # greedy selection's kernels
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0
