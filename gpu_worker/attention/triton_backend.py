"""Our Triton backend: paged decode / verify / draft reads and paged extend, no gathers.

Per forward ``build`` splits the rows in two groups by the host-known query counts: a tail of
rows sharing one of the engine's decode counts (decode T=1, MTP verify T=S+1, the draft's
Q-only read) goes to the split-KV decode kernel; every other row (prefill chunks, however
short) goes to the extend kernel. Rows are token-contiguous and the plan puts extend rows
first, so each group is one contiguous token range. Per layer there are at most two launches.

The decode metadata can also be built from device tensors alone (``decode_meta``): that is what
CUDA graphs capture, with the split count a function of the batch size only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.attention import register
from gpu_worker.attention.base import AttentionBackend, RowLayout
from gpu_worker.device import h2d
from gpu_worker.forward_batch import AttnLayer, ForwardBatch
from gpu_worker.kernels.attention_decode import paged_decode
from gpu_worker.kernels.attention_extend import extend_block_m, extend_blocks, paged_extend
from gpu_worker.upload import staged

DECODE_MAX_Q = 16
CPU_SMS = 2  # under the interpreter every program is Python: split little, but still split


@dataclass
class DecodePart:
    tok0: int  # first flat token of the group
    t: int  # queries per row
    slots: torch.Tensor  # [B]
    kv_lens: torch.Tensor  # [B]
    q_pos: torch.Tensor  # [B*t]
    num_splits: int
    order: torch.Tensor | None = None  # launch order, longest row first (see launch_order)


@dataclass
class ExtendPart:
    tok_end: int  # the group is tokens [0, tok_end)
    slots: torch.Tensor
    kv_lens: torch.Tensor
    q_pos: torch.Tensor
    blocks: torch.Tensor  # [3, NB]
    block_m: int


@dataclass
class TritonStaged:
    ext_blocks: torch.Tensor = staged()  # [3, NB] the extend kernel's query blocks


@dataclass
class TritonMeta:
    decode: DecodePart | None
    extend: ExtendPart | None


def decode_splits(batch: int, kv_heads: int, sms: int) -> int:
    """Split-KV pieces so that batch x heads x splits fills the SMs about twice (a power of 2).
    A function of the batch size only, so a graph replay launches what its capture did."""
    want = max(1, (2 * sms) // max(1, batch * kv_heads))
    return min(16, 1 << (want.bit_length() - 1))


def launch_order(kv_lens: torch.Tensor, kv_heads: int, splits: int, sms: int) -> torch.Tensor | None:
    """The decode rows longest first, where the kernel's programs outnumber what the SMs hold
    at once (one split, rows x heads > 2 x SMs), so that the longest rows do not start last
    (kernels/attention_decode.py). One small sort per forward, shared by every layer; a
    function of the batch size only, like the split count (docs/decisions/attention.md)."""
    if splits > 1 or kv_lens.shape[0] * kv_heads <= 2 * sms:
        return None
    return torch.argsort(kv_lens, descending=True)


def decode_part(tok0: int, t: int, slots, kv_lens, q_pos, kv_heads: int, sms: int) -> DecodePart:
    splits = decode_splits(slots.shape[0], kv_heads, sms)
    return DecodePart(tok0, t, slots, kv_lens, q_pos, splits, launch_order(kv_lens, kv_heads, splits, sms))


def decode_start(q_lens: np.ndarray, decode_q_lens: frozenset = frozenset({1})) -> int:
    """First row of the decode group: the longest tail of rows sharing one query count that the
    engine's decode steps use (``decode_q_lens``: 1 for decode and the draft's read, S+1 for
    MTP verify). A short prefill row of another count (a prompt or last chunk of a few tokens)
    goes to the extend kernel: the decode kernel's query count is a compile-time constant, so
    each new count would compile a variant while serving (a latency spike)."""
    b = len(q_lens)
    first = b
    if b and q_lens[-1] <= DECODE_MAX_Q and int(q_lens[-1]) in decode_q_lens:
        while first > 0 and q_lens[first - 1] == q_lens[-1]:
            first -= 1
    return first


@register("triton")
class TritonAttentionBackend(AttentionBackend):
    def __init__(self, pool, page_table):
        super().__init__(pool, page_table)
        self.block_m = extend_block_m([s.head_dim for s in pool.shapes] + [s.v_dim for s in pool.shapes] or [64])
        self.kv_heads = max([s.num_kv_heads for s in pool.shapes] or [1])
        dev = page_table.device
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else CPU_SMS

    # ------------------------------------------------------------ metadata
    def decode_meta(self, slots: torch.Tensor, kv_lens: torch.Tensor, q_pos: torch.Tensor, t: int) -> TritonMeta:
        """Device-only metadata for B rows of t queries each (graph-capturable)."""
        return TritonMeta(decode_part(0, t, slots, kv_lens, q_pos, self.kv_heads, self.sms), None)

    def stage(self, q_lens: np.ndarray, slots=None, kv_exact=None) -> TritonStaged | None:
        first_dec = decode_start(q_lens, self.decode_q_lens)
        return TritonStaged(extend_blocks(q_lens[:first_dec], self.block_m)) if first_dec else None

    def build(self, layout: RowLayout, windows: tuple[int, ...] = (), staged=None) -> TritonMeta:
        q_lens = np.asarray(layout.q_lens, dtype=np.int64)
        b = len(q_lens)
        first_dec = decode_start(q_lens, self.decode_q_lens)
        tok_split = int(q_lens[:first_dec].sum())
        dec = ext = None
        if first_dec < b:
            t = int(q_lens[-1])
            sl = slice(first_dec, b)
            dec = decode_part(tok_split, t, layout.slots[sl], layout.kv_lens[sl], layout.q_pos[tok_split:],
                              self.kv_heads, self.sms)
        if first_dec:
            blocks = staged.ext_blocks if staged is not None else None
            if blocks is None:
                blocks = h2d(extend_blocks(q_lens[:first_dec], self.block_m), layout.q_pos.device)
            blocks = blocks.view(3, -1)
            ext = ExtendPart(tok_split, layout.slots[:first_dec], layout.kv_lens[:first_dec],
                             layout.q_pos[:tok_split], blocks, self.block_m)
        return TritonMeta(dec, ext)

    # ------------------------------------------------------------ per layer
    def forward(self, layer: AttnLayer, q, k, v, fb: ForwardBatch, out: torch.Tensor | None = None) -> torch.Tensor:
        if k is not None:
            self.pool.write(layer.kv_layer, fb.out_loc, k, v)
        meta: TritonMeta = fb.attn
        if out is None:
            out = q.new_empty(q.shape[0], q.shape[1], self.pool.v[layer.kv_layer].shape[-1])
        if meta.extend is not None:
            self.run_extend(layer, q, meta.extend, out)
        if meta.decode is not None:
            self.run_decode(layer, q, meta.decode, out)
        return out

    def _common(self, layer: AttnLayer) -> dict:
        pool = self.pool
        return dict(page_size=pool.page_size, scale=layer.scaling, window=layer.sliding_window,
                    softcap=layer.logit_softcap, kv_scales=(pool.k_scale[layer.kv_layer], pool.v_scale[layer.kv_layer]))

    def run_extend(self, layer: AttnLayer, q, e: ExtendPart, out) -> None:
        """Tokens [0, e.tok_end) of q into the same rows of out (KV already written)."""
        kc, vc = self.pool.k[layer.kv_layer], self.pool.v[layer.kv_layer]
        paged_extend(q[: e.tok_end], kc, vc, self.page_table, e.slots, e.kv_lens, e.q_pos, e.blocks,
                     block_m=e.block_m, out=out[: e.tok_end], **self._common(layer))

    def run_decode(self, layer: AttnLayer, q, d: DecodePart, out) -> None:
        """Tokens [d.tok0, end) of q into the same rows of out (KV already written)."""
        kc, vc = self.pool.k[layer.kv_layer], self.pool.v[layer.kv_layer]
        paged_decode(q[d.tok0:], kc, vc, self.page_table, d.slots, d.kv_lens, d.q_pos, t=d.t,
                     num_splits=d.num_splits, out=out[d.tok0:], order=d.order, **self._common(layer))
