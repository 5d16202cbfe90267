"""Decode steps from slot ids alone, and their CUDA graphs per batch bucket.

A decode-only step needs nothing from the host but the slot ids: tokens, positions, KV write
locations and attention lengths all come from per-slot device state (``slots.py``). So the
step's device work is two functions of a static ``slots`` buffer:

- ``draft``: the bonus token of each row and, with MTP, the whole draft loop (S assistant
  forwards over the target's KV, each followed by its argmax) -> ``tokens`` [B, T];
- ``target``: the target forward over those T tokens per row (decode T=1, verify T=S+1),
  writing their KV, then the LM head -> ``hidden`` [B*T, H] and ``logits`` [B*T, V] (``compute_logits``' dtype).

``DecodeGraphs`` captures both per batch bucket at start-up (largest first, one shared memory
pool) and replays them; rows past the real batch point at slot 0, the padding row, whose
length is 0 and whose pages are page 0, so they read nothing and write only page 0. Without an
assistant the bonus gather is captured at the head of the target graph.

- ``tail``: for steps whose rows are all greedy with no logit processors or logprobs, argmax,
  MTP's greedy accept and the slot-state update as one more graph (``kernels/decode_tail.py``),
  writing tokens and accept counts into the bucket's ``result`` buffer: the step then runs no
  eager op between its replays and its one copy home. Token selection that depends on other
  per-request options (sampling, penalties, min_tokens, logprobs) runs after the replay, outside
  the graphs, so graphs stay exact for every request mix.

Invariant: a bucket's static outputs are rewritten by its next replay; every reader of a step's
outputs is queued on the same stream before the next step's replay.
On the CPU (and with ``emulate``) the same code runs eagerly on the same padded buffers: CI
checks the padding and bucket logic that the graphs rely on.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.kernels.argmax import argmax_last
from gpu_worker.kernels.decode_inputs import decode_inputs, draft_inputs
from gpu_worker.kernels.decode_tail import greedy_tail
from gpu_worker.spec.mtp import DRAFT_ROPE_OFFSET, draft_chain

log = logging.getLogger("tandem.worker")

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160, 192, 224, 256)


def graph_buckets(requested: tuple[int, ...] | None, max_bs: int | None, max_slots: int) -> list[int]:
    """Bucket sizes to capture: the requested list or the defaults, capped by the flags and the
    slot count; the largest bucket always covers ``min(max_bs, max_slots)``."""
    cap = min(max_bs or max_slots, max_slots)
    base = sorted({b for b in (requested or DEFAULT_BUCKETS) if 0 < b <= cap})
    if not requested and (not base or base[-1] < cap):
        base.append(cap)
    return base


def fitting_bucket(sizes: list[int], n: int) -> int | None:
    """The smallest of the sorted ``sizes`` that holds ``n``, or None."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class DecodeBody:
    """The device half of a decode-only step (graph-capturable: no host reads, fixed shapes)."""

    def __init__(self, target, assistant, backend, state, t: int):
        self.target, self.assistant, self.backend, self.state, self.t = target, assistant, backend, state, t

    def draft(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """With MTP: the bonus and the S drafts into ``tokens``. Plain decode: nothing here
        (``forward`` writes the bonus with the step's other inputs)."""
        if self.assistant is None:
            return
        st = self.state
        seq, q_pos, rope_pos, hidden = draft_inputs(slots, st.seq_len, st.last_token, st.hidden, tokens,
                                                    DRAFT_ROPE_OFFSET)  # the bonus into tokens[:, 0]
        meta = self.backend.decode_meta(slots, seq, q_pos, 1)  # exactly the committed keys
        fb = ForwardBatch(None, rope_pos, None, meta, slots.shape[0])
        draft_chain(self.assistant, self.backend, fb, tokens, hidden, self.t - 1)

    def forward(self, slots: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        st, t = self.state, self.t
        bonus_into = tokens if self.assistant is None else None
        _, pos, out_loc, kv_len = decode_inputs(slots, st.seq_len, st.last_token, st.page_table,
                                                self.backend.pool.page_size, t, bonus_into)
        meta = self.backend.decode_meta(slots, kv_len, pos, t)
        fb = ForwardBatch(tokens.reshape(-1), pos, out_loc, meta, slots.shape[0] * t)
        hidden = self.target.forward(fb, self.backend)
        return hidden, self.target.compute_logits(hidden)

    def tail(self, slots: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor,
             result: torch.Tensor) -> None:
        """All-greedy rows: tokens, accept counts and the slot-state update (decode_tail.py)."""
        st = self.state
        greedy_tail(slots, tokens, argmax_last(logits), hidden, st.seq_len, st.last_token, st.hidden, result)


@dataclass
class _Bucket:
    size: int
    slots: torch.Tensor  # [B] static input
    tokens: torch.Tensor  # [B, T] draft output = target input
    result: torch.Tensor  # [B, T + 1] int32: the greedy tail's tokens and accept counts
    draft: object | None = None  # torch.cuda.CUDAGraph
    target: object | None = None
    tail: object | None = None
    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class DecodeGraphs:
    def __init__(self, body: DecodeBody, buckets: list[int], emulate: bool = False):
        self.body = body
        self.device = body.state.device
        self.capture_graphs = self.device.type == "cuda" and not emulate
        self.buckets = {b: _Bucket(b, torch.zeros(b, dtype=torch.int64, device=self.device),
                                   torch.zeros(b, body.t, dtype=torch.int64, device=self.device),
                                   torch.zeros(b, body.t + 1, dtype=torch.int32, device=self.device))
                        for b in buckets}
        self.sizes = sorted(buckets)
        # Host mirror of each bucket's slot buffer, in launch order: only ``run`` writes either.
        self._held = {b: np.zeros(b, dtype=np.int64) for b in buckets}

    def bucket(self, n: int) -> int | None:
        return fitting_bucket(self.sizes, n)

    def capture(self) -> None:
        if not self.capture_graphs:
            return
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in sorted(self.buckets, reverse=True):
                self._capture_one(self.buckets[size], pool)
            # A graph's first launch also uploads it to the device, several times a replay's
            # cost: pay that here, not in the first user steps. Every slot is 0 (padding), so
            # these replays write page 0 only.
            for b in self.buckets.values():
                for graph in (b.draft, b.target, b.tail):
                    if graph is not None:
                        graph.replay()
        torch.cuda.synchronize(self.device)
        used = (free0 - torch.cuda.mem_get_info(self.device)[0]) / 2**20
        log.info("CUDA graphs: captured decode%s + greedy tail for batch sizes %s in %.1f s, %.0f MiB",
                 " + draft loop" if self.body.assistant is not None else "", self.sizes,
                 time.perf_counter() - t0, used)

    def _capture_one(self, b: _Bucket, pool) -> None:
        body = self.body
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: compiles every kernel for this shape
            for _ in range(2):  # (every slot is 0: the tail writes no state)
                body.draft(b.slots, b.tokens)
                hidden, logits = body.forward(b.slots, b.tokens)
                body.tail(b.slots, b.tokens, hidden, logits, b.result)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if body.assistant is not None:
            b.draft = torch.cuda.CUDAGraph()
            with torch.cuda.graph(b.draft, pool=pool):
                body.draft(b.slots, b.tokens)
        b.target = torch.cuda.CUDAGraph()
        with torch.cuda.graph(b.target, pool=pool):
            b.hidden, b.logits = body.forward(b.slots, b.tokens)  # plain decode: the bonus gather too
        b.tail = torch.cuda.CUDAGraph()
        with torch.cuda.graph(b.tail, pool=pool):
            body.tail(b.slots, b.tokens, b.hidden, b.logits, b.result)

    def holds(self, bucket: int, padded: np.ndarray) -> bool:
        """Whether the bucket's slot buffer holds ``padded`` once every launched replay has run
        (then a step need not upload its slots: decode batches repeat step after step)."""
        return np.array_equal(self._held[bucket], padded)

    def slots(self, n: int) -> torch.Tensor:
        """The device slot ids of the last ``run(n, ...)`` (valid until the bucket's next run)."""
        return self.buckets[self.bucket(n)].slots[:n]

    def run(self, n: int, padded: np.ndarray, padded_dev: torch.Tensor | None, mark):
        """Replay the bucket for ``n`` rows, slots ``padded`` (the bucket's length, padding 0),
        copied in from ``padded_dev`` unless the buffer already holds them (``holds``; then
        None). ``mark()`` is called between the draft and the target part (step timing).
        -> (tokens [n, T], hidden [n*T, H], logits [n*T, V])."""
        size = self.bucket(n)
        b = self.buckets[size]
        t = self.body.t
        if padded_dev is not None:
            b.slots.copy_(padded_dev)
            self._held[size] = padded
        else:
            assert self.holds(size, padded), "a bucket's slots were neither held nor staged"
        if b.draft is not None:
            b.draft.replay()
        elif b.target is None:
            self.body.draft(b.slots, b.tokens)
        mark()
        if b.target is not None:
            b.target.replay()
            hidden, logits = b.hidden, b.logits
        else:
            b.hidden, b.logits = hidden, logits = self.body.forward(b.slots, b.tokens)
        return b.tokens[:n], hidden[: n * t], logits[: n * t]

    def run_tail(self, n: int) -> torch.Tensor:
        """After ``run(n, ...)`` of an all-greedy step: the greedy tail -> result [n, T + 1]
        (tokens, accept count; the slot state already updated)."""
        b = self.buckets[self.bucket(n)]
        if b.tail is not None:
            b.tail.replay()
        else:
            self.body.tail(b.slots, b.tokens, b.hidden, b.logits, b.result)
        return b.result[:n]
