"""FlashInfer backend: FlashInfer's paged prefill and decode kernels wherever the host knows
every row's KV length exactly; our Triton kernels everywhere else.

FlashInfer's ``plan()`` splits the work from host-side lengths and its kernels trust the split:
a row shorter than planned underflows a split's length (``decode.cuh``). So each forward goes:

- prefill / extend rows (their lengths are in the step plan) -> ``BatchPrefillWithPagedKVCacheWrapper``;
- decode rows without MTP (a step adds exactly one token, so ``SlotState.seq_host`` mirrors the
  device lengths) -> ``BatchDecodeWithPagedKVCacheWrapper``: eager, or in CUDA graphs one
  wrapper per (bucket, layer kind), re-planned before every replay, outside the graph;
- MTP verify rows and the draft's Q-only reads -> triton: under overlap their lengths depend on
  the previous step's accept counts, which reach the host a step later;
- layers FlashInfer has no kernel for (head dim not 64 / 128 / 256, K and V dims differing:
  Gemma 4's 512-dim global layers) -> triton, per layer;
- with an FP8 KV cache, extend rows -> triton (decode rows stay on FlashInfer, which reads e4m3
  with the pool's k / v scales).
Start-up logs which of these apply.

Rows use the triton backend's grouping (``decode_start``): extend rows first, then a tail of
decode rows; the triton metadata is always built too, so any layer or group can fall back.

Invariant (the plan-buffer race reference engines hit): ``plan()`` writes a pinned host buffer
and queues its copy to the device; a wrapper is re-planned only after the event recorded behind
its previous plan has fired, so a queued copy never reads a rewritten buffer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from gpu_worker.attention import register
from gpu_worker.attention.base import AttentionBackend, RowLayout
from gpu_worker.attention.triton_backend import TritonAttentionBackend, TritonMeta, TritonStaged, decode_start
from gpu_worker.device import h2d
from gpu_worker.forward_batch import AttnLayer, ForwardBatch
from gpu_worker.upload import staged

log = logging.getLogger("tandem.worker")

FI_HEAD_DIMS = (64, 128, 256)
FI_DTYPES = (torch.bfloat16, torch.float16)
WORKSPACE_BYTES = 256 << 20  # split-KV partial outputs, shared by every wrapper (one stream)
TENSOR_CORE_GROUP = 4  # GQA group size from which decode uses the tensor-core (prefill) kernel


@dataclass(frozen=True)
class Kind:
    """What a plan depends on besides the rows: one wrapper per kind."""

    q_heads: int
    kv_heads: int
    head_dim: int
    window_left: int  # -1: full attention
    softcap: float  # 0: none
    scale: float
    dtype: torch.dtype
    kv_dtype: torch.dtype

    @property
    def tensor_cores(self) -> bool:
        return self.q_heads // self.kv_heads >= TENSOR_CORE_GROUP


@dataclass
class HostGroup:
    """Host plan arrays of one group of rows (tokens [tok0, tok1))."""

    tok0: int
    tok1: int
    qo_indptr: np.ndarray  # int32 [n+1]
    kv_indptr: np.ndarray  # int32 [n+1], in pages
    last_page_len: np.ndarray  # int32 [n]
    flat: np.ndarray  # int64 [pages]: slot * max_pages + column, into the page table


def host_group(q_lens, slots, kv, tok0: int, page_size: int, max_pages: int) -> HostGroup:
    kv = np.maximum(np.asarray(kv, dtype=np.int64), 1)  # a padding row reads one key of page 0
    pages = (kv + page_size - 1) // page_size
    kv_indptr = np.concatenate([[0], np.cumsum(pages)])
    cols = np.arange(kv_indptr[-1]) - np.repeat(kv_indptr[:-1], pages)
    flat = np.repeat(np.asarray(slots, dtype=np.int64) * max_pages, pages) + cols
    qo = np.concatenate([[0], np.cumsum(q_lens)])
    return HostGroup(tok0, tok0 + int(qo[-1]), qo.astype(np.int32), kv_indptr.astype(np.int32),
                     (kv - (pages - 1) * page_size).astype(np.int32), flat)


@dataclass
class HostPlan:
    ext: HostGroup | None
    dec: HostGroup | None

    def flat(self) -> np.ndarray:
        parts = [g.flat for g in (self.ext, self.dec) if g is not None]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


@dataclass
class FiStaged:
    """A forward's host plan and its page-table indices (staged), with the triton fallback's."""

    plan: HostPlan
    flat: torch.Tensor = staged()
    triton: TritonStaged | None = staged(default=None)


@dataclass
class FiGraphStaged:
    """A decode graph replay's host plan (padded to the bucket) and its page-table indices."""

    group: HostGroup
    flat: torch.Tensor = staged()


class _Planned:
    """A wrapper and the event behind its last plan (see the module invariant)."""

    def __init__(self, wrapper, cuda: bool):
        self.w, self.cuda = wrapper, cuda
        self.event = None

    def plan(self, *args, **kwargs) -> None:
        if self.event is not None:
            self.event.synchronize()
        self.w.plan(*args, **kwargs)
        if self.cuda:
            self.event = torch.cuda.Event()
            self.event.record()


@dataclass
class EagerGroup:
    """A group of one eager forward; each kind is planned at its first layer."""

    mode: str  # "prefill" | "decode"
    host: HostGroup
    indices: torch.Tensor  # int32 page ids on the device
    planned: dict = field(default_factory=dict)  # Kind -> _Planned

    def wrapper(self, be: "FlashInferBackend", kind: Kind):
        p = self.planned.get(kind)
        if p is None:
            p = self.planned[kind] = be.eager_wrapper(self.mode, kind)
            be.plan(p, self.mode, kind, self.host, self.indices)
        return p.w


class GraphSet:
    """One decode bucket's CUDA-graph wrappers: fixed device buffers, one wrapper per kind."""

    def __init__(self, be: "FlashInferBackend", bucket: int):
        dev = be.page_table.device
        self.be, self.bucket = be, bucket
        self.indptr = torch.arange(bucket + 1, dtype=torch.int32, device=dev)
        self.indices = torch.zeros(bucket * be.max_pages, dtype=torch.int32, device=dev)
        self.last = torch.ones(bucket, dtype=torch.int32, device=dev)
        self.wrappers: dict[Kind, _Planned] = {}
        # until the first replay: every row is padding (slot 0, one key of page 0)
        self.host = host_group(np.ones(bucket), np.zeros(bucket), np.ones(bucket), 0, be.pool.page_size, be.max_pages)
        self.src = torch.zeros(bucket, dtype=torch.int32, device=dev)

    def wrapper(self, be: "FlashInferBackend", kind: Kind):
        p = self.wrappers.get(kind)
        if p is None:
            if be.cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("flashinfer: a layer kind first seen inside graph capture")
            p = self.wrappers[kind] = _Planned(be.fi.BatchDecodeWithPagedKVCacheWrapper(
                be.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=kind.tensor_cores,
                paged_kv_indptr_buffer=self.indptr, paged_kv_indices_buffer=self.indices,
                paged_kv_last_page_len_buffer=self.last), be.cuda)
            be.plan(p, "decode", kind, self.host, self.src)
        return p.w

    def replan(self, host: HostGroup, indices: torch.Tensor) -> None:
        self.host, self.src = host, indices
        for kind, p in self.wrappers.items():
            self.be.plan(p, "decode", kind, host, indices)


@dataclass
class FiMeta:
    triton: TritonMeta  # always there: the fallback for every group and layer
    ext: EagerGroup | None
    dec: EagerGroup | GraphSet | None


@register("flashinfer")
class FlashInferBackend(AttentionBackend):
    def __init__(self, pool, page_table):
        super().__init__(pool, page_table)
        import flashinfer

        self.fi = flashinfer
        self.triton = TritonAttentionBackend(pool, page_table)
        self.max_pages = page_table.shape[1]
        self.cuda = page_table.device.type == "cuda"
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=page_table.device)
        self._eager: dict[tuple[str, Kind], _Planned] = {}
        self._graphs: dict[int, GraphSet] = {}
        self._kinds: dict[tuple[int, int], Kind | None] = {}
        self._said_decode = False
        other = sorted({s.head_dim for s in pool.shapes if not _fi_shape(s)})
        if other:
            n = sum(not _fi_shape(s) for s in pool.shapes)
            log.info("flashinfer: %d of %d KV layers (head dims %s) run on triton: FlashInfer has no kernel "
                     "for them", n, len(pool.shapes), other)
        if pool.fp8:
            log.info("flashinfer: with the FP8 KV cache, prefill and extend rows run on triton")

    @property
    def decode_q_lens(self) -> frozenset:
        return self.triton.decode_q_lens

    @decode_q_lens.setter
    def decode_q_lens(self, counts: frozenset) -> None:
        # One grouping for both: the triton metadata built beside every plan must split the rows
        # where the plan does (a verify row planned as decode but built as extend reads garbage).
        self.triton.decode_q_lens = counts

    # ------------------------------------------------------------ plans
    def eager_wrapper(self, mode: str, kind: Kind) -> _Planned:
        key = (mode, kind)
        if key not in self._eager:
            if mode == "prefill":
                w = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
            else:
                w = self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                               use_tensor_cores=kind.tensor_cores)
            self._eager[key] = _Planned(w, self.cuda)
        return self._eager[key]

    def plan(self, p: _Planned, mode: str, kind: Kind, g: HostGroup, indices: torch.Tensor) -> None:
        ps = self.pool.page_size
        common = dict(window_left=kind.window_left, logits_soft_cap=kind.softcap or None, sm_scale=kind.scale,
                      q_data_type=kind.dtype, kv_data_type=kind.kv_dtype)
        kv_indptr, last = torch.from_numpy(g.kv_indptr), torch.from_numpy(g.last_page_len)
        if mode == "prefill":
            p.plan(torch.from_numpy(g.qo_indptr), kv_indptr, indices, last, kind.q_heads, kind.kv_heads,
                   kind.head_dim, ps, causal=True, **common)
        else:
            p.plan(kv_indptr, indices, last, kind.q_heads, kind.kv_heads, kind.head_dim, ps, **common)

    def _host_plan(self, q_lens: np.ndarray, slots, kv_exact) -> HostPlan:
        if slots is None or kv_exact is None:
            return HostPlan(None, None)
        q_lens = np.asarray(q_lens, dtype=np.int64)
        kv_exact = np.asarray(kv_exact, dtype=np.int64)
        first, b = decode_start(q_lens, self.decode_q_lens), len(q_lens)
        split = int(q_lens[:first].sum())
        ps, mp = self.pool.page_size, self.max_pages
        ext = host_group(q_lens[:first], slots[:first], kv_exact[:first], 0, ps, mp) if first else None
        dec = None
        if first < b and q_lens[-1] == 1 and self.host_decode_lens and (kv_exact[first:] > 0).all():
            dec = host_group(q_lens[first:], slots[first:], kv_exact[first:], split, ps, mp)
        elif first < b and not self._said_decode:
            self._said_decode = True
            log.info("flashinfer: decode rows whose KV length the host does not know (MTP verify under "
                     "overlap, draft reads) run on triton")
        return HostPlan(ext, dec)

    # ------------------------------------------------------------ metadata
    def stage(self, q_lens: np.ndarray, slots=None, kv_exact=None) -> FiStaged:
        plan = self._host_plan(q_lens, slots, kv_exact)
        return FiStaged(plan, plan.flat(), self.triton.stage(q_lens))

    def build(self, layout: RowLayout, windows: tuple[int, ...] = (), staged: FiStaged | None = None) -> FiMeta:
        tm = self.triton.build(layout, windows, staged.triton if staged is not None else None)
        if staged is not None:
            plan, flat = staged.plan, staged.flat
        else:
            plan = self._host_plan(layout.q_lens, layout.slots_host, layout.kv_exact)
            flat = h2d(plan.flat(), self.page_table.device)
        if plan.ext is None and plan.dec is None:
            return FiMeta(tm, None, None)
        # page ids read after this step's page-table appends (stream order)
        indices = self.page_table.view(-1)[flat]
        n_ext = len(plan.ext.flat) if plan.ext is not None else 0
        ext = EagerGroup("prefill", plan.ext, indices[:n_ext]) if plan.ext is not None else None
        dec = EagerGroup("decode", plan.dec, indices[n_ext:]) if plan.dec is not None else None
        return FiMeta(tm, ext, dec)

    def decode_meta(self, slots: torch.Tensor, kv_lens: torch.Tensor, q_pos: torch.Tensor, t: int):
        """Graph-captured decode: FlashInfer for plain decode, triton for MTP (lengths on the device)."""
        tm = self.triton.decode_meta(slots, kv_lens, q_pos, t)
        if not self.host_decode_lens or t != 1:
            return tm
        return FiMeta(tm, None, self._graph_set(slots.shape[0]))

    def _graph_set(self, bucket: int) -> GraphSet:
        if bucket not in self._graphs:
            self._graphs[bucket] = GraphSet(self, bucket)
        return self._graphs[bucket]

    def stage_graph(self, bucket: int, slots: np.ndarray, kv_exact) -> FiGraphStaged | None:
        if not self.host_decode_lens or kv_exact is None:
            return None
        n = len(slots)
        pad_slots, pad_kv = np.zeros(bucket, np.int64), np.ones(bucket, np.int64)
        pad_slots[:n], pad_kv[:n] = slots, kv_exact
        g = host_group(np.ones(bucket), pad_slots, pad_kv, 0, self.pool.page_size, self.max_pages)
        return FiGraphStaged(g, g.flat)

    def prepare_graph(self, bucket: int, staged: FiGraphStaged | None) -> None:
        if staged is not None:
            self._graph_set(bucket).replan(staged.group, self.page_table.view(-1)[staged.flat])

    # ------------------------------------------------------------ per layer
    def _kind(self, layer: AttnLayer, q: torch.Tensor) -> Kind | None:
        key = (id(layer), q.shape[1])
        if key not in self._kinds:
            s = self.pool.shapes[layer.kv_layer]
            ok = _fi_shape(s) and q.dtype in FI_DTYPES and q.shape[1] % s.num_kv_heads == 0
            win = layer.sliding_window - 1 if layer.sliding_window else -1
            self._kinds[key] = Kind(q.shape[1], s.num_kv_heads, s.head_dim, win, float(layer.logit_softcap or 0.0),
                                    float(layer.scaling), q.dtype, self.pool.dtype) if ok else None
        return self._kinds[key]

    def forward(self, layer: AttnLayer, q, k, v, fb: ForwardBatch, out: torch.Tensor | None = None) -> torch.Tensor:
        meta = fb.attn
        if not isinstance(meta, FiMeta):
            return self.triton.forward(layer, q, k, v, fb, out)
        if k is not None:
            self.pool.write(layer.kv_layer, fb.out_loc, k, v)
        kc, vc = self.pool.k[layer.kv_layer], self.pool.v[layer.kv_layer]
        if out is None:
            out = q.new_empty(q.shape[0], q.shape[1], vc.shape[-1])
        kind = self._kind(layer, q)
        tm, ps = meta.triton, self.pool.page_size
        paged = (kc.view(-1, ps, kc.shape[1], kc.shape[2]), vc.view(-1, ps, vc.shape[1], vc.shape[2]))
        if tm.extend is not None:
            if kind is not None and meta.ext is not None and not self.pool.fp8:
                g = meta.ext.host
                meta.ext.wrapper(self, kind).run(q[g.tok0:g.tok1].contiguous(), paged, out=out[g.tok0:g.tok1])
            else:
                self.triton.run_extend(layer, q, tm.extend, out)
        if tm.decode is not None:
            if kind is not None and meta.dec is not None:
                t0 = tm.decode.tok0
                scales = dict(k_scale=self.pool.k_scale[layer.kv_layer],
                              v_scale=self.pool.v_scale[layer.kv_layer]) if self.pool.fp8 else {}
                meta.dec.wrapper(self, kind).run(q[t0:].contiguous(), paged, out=out[t0:], **scales)
            else:
                self.triton.run_decode(layer, q, tm.decode, out)
        return out


def _fi_shape(s) -> bool:
    return s.head_dim in FI_HEAD_DIMS and s.v_dim == s.head_dim
