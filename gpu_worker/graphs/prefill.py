"""Piecewise CUDA graphs for steps with prefill chunks: the target forward captured per token
bucket in pieces cut at each layer's attention.

Why: an eager prefill step launches ~11 kernels a layer, and each launch costs tens of
microseconds of host time (Triton's Python launcher, cuBLAS's host side): on a long prefill
step of a small model the host takes about as long as the kernels, so the GPU waits on it
(docs/decisions/graphs.md). Everything in the forward but attention depends only on the token count; attention's
launch depends on the rows' lengths. So for each bucket of N
tokens the forward is captured as L+1 graphs: piece i ends with layer i's rotated q (and its KV
written) in a static buffer; the attention then runs eagerly with this step's metadata into a
second static buffer, which piece i+1 starts from. vLLM and SGLang capture prefill the same way.

Padding: tokens n..N of a bucket have stale ids and positions (harmless values) and KV location
0, which is on page 0, the padding page that no real row reads. The eager attention sees only
the n real tokens, and no op mixes tokens, so padding never reaches a real token.

Invariants: the static buffers (ids, positions, locations, q, attention output, the final hidden
state) are rewritten by the next replay, and every reader of a step's hidden state (LM head,
prompt logprobs, the draft's hidden copy) is queued on the same stream before it. All buckets'
pieces share one memory pool: a bucket's pieces replay in capture order, and buckets never run
at the same time. On the CPU (``emulate``) the same padded path runs eagerly, so CI checks it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from gpu_worker.graphs.decode import fitting_bucket
from gpu_worker.forward_batch import AttnLayer, ForwardBatch

log = logging.getLogger("tandem.worker")

# Bucket steps: fine where padding would cost most relative to the work, coarser above 4096
# (at most 1023 pad tokens there, under 25 %; full-budget chunks land on the top bucket).
_SMALL = (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 2560, 3072, 3584, 4096)
# Captured up to the step budget, at most this many tokens: past it a step's kernels outlast its
# launches' host time even eagerly, and each bucket costs start-up time (a warm-up forward).
MAX_TOKENS = 16384


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture, up to ``max_tokens`` (the step budget), which is always one."""
    top = -(-max_tokens // 16) * 16
    sizes = {b for b in _SMALL if b < top} | set(range(5120, top, 1024)) | {top}
    return sorted(sizes)


class Scratch:
    """The two per-layer static buffers: rotated q and the attention output, flat and viewed
    per layer (head counts and dims differ between layers, e.g. Gemma 4). Grown during the
    warm-up forward of the largest bucket, then frozen: a capture must not reallocate."""

    def __init__(self, max_tokens: int, dtype: torch.dtype, device: torch.device):
        self.max_tokens, self.dtype, self.device = max_tokens, dtype, device
        self.bufs: dict[str, torch.Tensor] = {}
        self.frozen = False

    def view(self, name: str, t: int, h: int, d: int) -> torch.Tensor:
        need = self.max_tokens * h * d
        buf = self.bufs.get(name)
        if buf is None or buf.numel() < need:
            if self.frozen:
                raise RuntimeError(f"piecewise graphs: scratch {name!r} too small for {h} x {d}")
            buf = self.bufs[name] = torch.zeros(need, dtype=self.dtype, device=self.device)
        return buf[: t * h * d].view(t, h, d)


@dataclass
class _Piece:
    graph: object  # torch.cuda.CUDAGraph ending just before `layer`'s attention
    layer: AttnLayer
    q: torch.Tensor  # [N, Hq, D] scratch view the piece writes
    out: torch.Tensor  # [N, Hq, Dv] scratch view the next piece reads


@dataclass
class _Bucket:
    size: int
    pieces: list[_Piece] = field(default_factory=list)
    last: object | None = None  # the graph after the last attention
    hidden: torch.Tensor | None = None  # [N, H] static output


class _Splitter:
    """Stands in for the attention backend while the target forward runs over a bucket's
    padded buffers. ``mode``: "warm" (no attention: compiles the pieces' kernels), "capture"
    (ends the current graph at each attention, records the piece, starts the next graph), or
    "eager" (runs the real attention on the real tokens: the CPU twin)."""

    def __init__(self, real, scratch: Scratch, mode: str, pool=None, real_fb: ForwardBatch | None = None):
        self.real, self.scratch, self.mode, self.graph_pool, self.real_fb = real, scratch, mode, pool, real_fb
        self.pieces: list[_Piece] = []
        self.graph = None

    def __getattr__(self, name):  # pool, page_table, ...: the real backend's
        return getattr(self.real, name)

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.graph_pool)

    def forward(self, layer: AttnLayer, q, k, v, fb: ForwardBatch, out=None) -> torch.Tensor:
        o = self.scratch.view("out", q.shape[0], q.shape[1], self.real.pool.v[layer.kv_layer].shape[-1])
        if self.mode == "capture":
            self.graph.capture_end()
            self.pieces.append(_Piece(self.graph, layer, q, o))
            self.begin()
        elif self.mode == "eager":
            n = self.real_fb.num_tokens
            self.real.forward(layer, q[:n], None if k is None else k[:n], None if v is None else v[:n],
                              self.real_fb, out=o[:n])
        return o


class PrefillGraphs:
    def __init__(self, target, backend, max_tokens: int, dtype: torch.dtype, device: torch.device,
                 emulate: bool = False):
        self.target, self.backend, self.device = target, backend, device
        self.capture_graphs = device.type == "cuda" and not emulate
        self.sizes = prefill_buckets(max_tokens)
        top = self.sizes[-1]
        self.ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.pos = torch.zeros(top, dtype=torch.int64, device=device)
        self.loc = torch.zeros(top, dtype=torch.int64, device=device)
        self.scratch = Scratch(top, dtype, device)
        self.buckets: dict[int, _Bucket] = {}

    def bucket(self, n: int) -> int | None:
        return fitting_bucket(self.sizes, n)

    def _padded_batch(self, n: int) -> ForwardBatch:
        return ForwardBatch(self.ids[:n], self.pos[:n], self.loc[:n], None, n, scratch=self.scratch)

    def capture(self) -> None:
        if not self.capture_graphs:
            return
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(side):
            for size in reversed(self.sizes):  # largest first: it sizes the scratch and the pool
                self.target.forward(self._padded_batch(size), _Splitter(self.backend, self.scratch, "warm"))
                self.scratch.frozen = True
                self.buckets[size] = self._capture_one(size, pool)
        torch.cuda.current_stream(self.device).wait_stream(side)
        with torch.inference_mode():
            for b in self.buckets.values():  # a graph's first launch uploads it: pay that here
                for piece in b.pieces:
                    piece.graph.replay()
                b.last.replay()
        torch.cuda.synchronize(self.device)
        used = (free0 - torch.cuda.mem_get_info(self.device)[0]) / 2**20
        log.info("CUDA graphs: captured piecewise prefill (%d pieces) for token counts %s in %.1f s, %.0f MiB",
                 len(self.buckets[self.sizes[-1]].pieces) + 1, self.sizes, time.perf_counter() - t0, used)

    def _capture_one(self, size: int, pool) -> _Bucket:
        split = _Splitter(self.backend, self.scratch, "capture", pool)
        split.begin()
        hidden = self.target.forward(self._padded_batch(size), split)
        split.graph.capture_end()
        return _Bucket(size, split.pieces, split.graph, hidden)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """The target forward of ``fb`` (n <= the largest bucket) -> hidden [n, H]."""
        n = fb.num_tokens
        size = self.bucket(n)
        self.ids[:n].copy_(fb.input_ids)
        self.pos[:n].copy_(fb.positions)
        self.loc[:n].copy_(fb.out_loc)
        self.loc[n:size].zero_()  # padding writes KV on page 0 only
        if not self.capture_graphs:
            split = _Splitter(self.backend, self.scratch, "eager", real_fb=fb)
            return self.target.forward(self._padded_batch(size), split)[:n]
        b = self.buckets[size]
        for piece in b.pieces:
            piece.graph.replay()
            self.backend.forward(piece.layer, piece.q[:n], None, None, fb, out=piece.out[:n])
        b.last.replay()
        return b.hidden[:n]
