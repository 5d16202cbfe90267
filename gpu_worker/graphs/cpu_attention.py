"""Decode attention for the compiled CPU steps: paged reads of fixed rank, through the library's
kernel (``tandem_cpu::paged_attention``, ``cpu_attn.cpp``) over a float32 pool, else as tensor ops
(``attend``: the kernel's reference too).

The decode, verify and draft steps (``graphs/decode.py``'s ``DecodeBody``) read attention
metadata that depends on device state alone (``decode_meta``). Here each row gathers its keys
from the paged pool and attends with a mask (the rule of ``attention/base.py``); every shape
is a function of the batch size, the tokens per row and one key bound ``K``, so the step
exports as one program with those sizes symbolic (``graphs/cpu_programs.py``):

- full layers gather keys ``[0, K)`` (``kv_cols``, an input of length K >= every row's length);
- sliding layers gather only the ``window + t - 1`` positions ending at the row's last query:
  no query of the row sees a key before that, so their cost does not grow with the context.

Rows whose mask is empty (never a real row: its committed length is at least 1) see key 0, so
no step produces a NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpu_worker.forward_batch import AttnLayer, ForwardBatch


@dataclass
class DecodeMeta:
    slots: torch.Tensor  # [B]
    kv_lens: torch.Tensor  # [B] keys each row sees
    q_pos: torch.Tensor  # [B * t] each query's mask position
    t: int
    reads: dict = field(default_factory=dict)  # window (0: full) -> (locations [B, K'], mask [B, t, K'])


class CpuDecodeAttention:
    """The backend a ``DecodeBody`` runs on in a compiled CPU step. ``page_table`` and
    ``kv_cols`` are the program's inputs while it is traced (``cpu_programs.py``). ``fused``: a
    float32 pool is read in place by the library's kernel (``tandem_cpu::paged_attention``,
    ``cpu_attn.cpp``), which a program may call where the build compiles the library."""

    def __init__(self, pool, page_table: torch.Tensor, fused: bool = False):
        self.pool = pool
        self.page_table = page_table
        self.fused = fused
        self.kv_cols: torch.Tensor | None = None  # arange(K)

    def decode_meta(self, slots: torch.Tensor, kv_lens: torch.Tensor, q_pos: torch.Tensor, t: int) -> DecodeMeta:
        return DecodeMeta(slots, kv_lens, q_pos, t)

    def _read(self, meta: DecodeMeta, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool locations and the mask of the keys a layer with ``window`` (0: full) reads."""
        if window in meta.reads:
            return meta.reads[window]
        b, t, ps = meta.slots.shape[0], meta.t, self.pool.page_size
        q_pos = meta.q_pos.view(b, t)
        if window:
            first = q_pos[:, :1] - (window - 1)  # the oldest key the row's first query sees
            pos = first + torch.arange(window + t - 1, device=q_pos.device)[None, :]
        else:
            pos = self.kv_cols[None, :].expand(b, -1)
        j = pos[:, None, :]  # [B, 1, K']
        ok = (j >= 0) & (j < meta.kv_lens.view(b, 1, 1)) & (j <= q_pos[:, :, None])
        if window:
            ok = ok & (j > q_pos[:, :, None] - window)
        ok = ok | (~ok.any(-1, keepdim=True) & (pos[:, None, :] == pos[:, None, :1]))  # never empty
        page = pos.clamp(min=0) // ps
        loc = self.page_table[meta.slots[:, None], page].long() * ps + pos.clamp(min=0) % ps
        meta.reads[window] = loc, ok
        return meta.reads[window]

    def forward(self, layer: AttnLayer, q: torch.Tensor, k, v, fb: ForwardBatch,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """q [B*t, Hq, D] -> [B*t, Hq, Dv]; k / v (when given) are written at ``fb.out_loc`` first."""
        if layer.logit_softcap is not None:
            raise NotImplementedError("attention logit softcap is not supported by the compiled CPU steps")
        kc, vc = self.pool.k[layer.kv_layer], self.pool.v[layer.kv_layer]
        if k is not None:
            self.pool.write(layer.kv_layer, fb.out_loc, k, v)
        meta: DecodeMeta = fb.attn
        loc, ok = self._read(meta, layer.sliding_window or 0)
        if self.fused and kc.dtype == torch.float32:
            return torch.ops.tandem_cpu.paged_attention(q.float(), kc, vc, loc, ok, layer.scaling).to(q.dtype)
        work = _work_dtype(q.dtype, kc.dtype)
        keys, vals = self.pool.read(layer.kv_layer, loc, work)
        return attend(q.to(work), keys, vals, ok, layer.scaling).to(q.dtype)


def attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, ok: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [B*t, Hq, D] over each row's gathered keys [B, K', Hkv, D] and values [B, K', Hkv, Dv],
    ``ok`` [B, t, K'] the keys each query sees -> [B*t, Hq, Dv], in q's dtype."""
    b, kp, hkv, d = keys.shape
    t, hq, dv = ok.shape[1], q.shape[1], vals.shape[-1]
    g = hq // hkv
    # Keys are the left operand: gathered as contiguous [D] rows, the layout a GEMM takes as
    # is (as the right operand the compiler laid them out transposed: a scalar gather each).
    keys, vals = keys.transpose(1, 2), vals.transpose(1, 2)  # [B, Hkv, K', D], [B, Hkv, K', Dv]
    qg = q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
    scores = (keys @ qg.transpose(-1, -2)).transpose(-1, -2).float() * scaling  # [B, Hkv, G*t, K']
    mask = ok[:, None, None].expand(b, 1, g, t, kp).reshape(b, 1, g * t, kp)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(q.dtype)
    o = (probs @ vals).view(b, hkv, g, t, dv).permute(0, 3, 1, 2, 4)
    return o.reshape(b * t, hq, dv)


def _work_dtype(q: torch.dtype, pool: torch.dtype) -> torch.dtype:
    """The dtype a layer attends in: the pool's where it is wider than the query's (the bfloat16
    draft over a float32 pool), else the query's. bfloat16 batched GEMMs run through oneDNN,
    which keeps kernels and buffers per shape, and the key bound changes every page: the draft's
    attention in bfloat16 held ~21 MB more over 8 streams; MKL's float32 ones keep
    nothing, and the keys need no conversion."""
    return pool if pool.is_floating_point and pool.itemsize > q.itemsize else q
