"""Reference backend: gather each row's pages into a padded batch and call SDPA.

Rows are split into at most two groups (short rows: decode / verify; long rows: prefill
chunks) so one long prefill does not pad every decode row to its length. Per forward the
index and mask tensors are built once; per layer there is one gather and one SDPA call per
group, never a Python loop over requests. Runs on CPU and CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from gpu_worker.attention import register
from gpu_worker.attention.base import AttentionBackend, RowLayout
from gpu_worker.device import h2d
from gpu_worker.forward_batch import AttnLayer, ForwardBatch

SHORT_Q = 16  # rows with at most this many queries form the "short" group


@dataclass
class _Group:
    gather: torch.Tensor  # [B, Q] index into q (T means the zero padding row)
    sel: torch.Tensor  # flat indices into [B*Q] holding real tokens
    tok: torch.Tensor  # the token index of each selected entry
    kv_loc: torch.Tensor  # [B, K] token locations in the pool
    masks: dict  # window (0 = full) -> bool [B, 1, Q, K]


class TorchMeta:
    def __init__(self, groups: list[_Group], num_tokens: int):
        self.groups = groups
        self.num_tokens = num_tokens


@register("torch")
class TorchAttentionBackend(AttentionBackend):
    def build(self, layout: RowLayout, windows: tuple[int, ...] = (), staged=None) -> TorchMeta:
        q_lens = np.asarray(layout.q_lens, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]) if len(q_lens) else q_lens
        total = int(q_lens.sum())
        short = q_lens <= SHORT_Q
        groups = []
        for rows in (np.nonzero(short)[0], np.nonzero(~short)[0]):
            if len(rows):
                groups.append(self._group(layout, rows, q_lens, starts, total, windows))
        return TorchMeta(groups, total)

    def _group(self, layout, rows, q_lens, starts, total, windows) -> _Group:
        dev = layout.q_pos.device
        ql = q_lens[rows]
        qmax = int(ql.max())
        kmax = max(int(layout.kv_bound[rows].max()), 1)
        qi = np.arange(qmax)[None, :]
        valid = qi < ql[:, None]
        gather = np.where(valid, starts[rows][:, None] + qi, total)
        sel = np.nonzero(valid.reshape(-1))[0]
        gather_t = h2d(gather, dev)
        rows_t = h2d(rows, dev)
        cols = torch.arange(kmax, device=dev)
        ps = self.pool.page_size
        pages = self.page_table[layout.slots[rows_t]][:, cols // ps].long()
        kv_loc = pages * ps + cols % ps
        q_pos = torch.cat([layout.q_pos, layout.q_pos.new_zeros(1)])[gather_t]  # [B, Q]
        j = cols.view(1, 1, kmax)
        base = (j <= q_pos[..., None]) & (j < layout.kv_lens[rows_t].view(-1, 1, 1))
        pad = h2d(~valid, dev)[..., None] & (j == 0)  # keep SDPA NaN-free
        masks = {0: (base | pad).unsqueeze(1)}
        for w in windows:
            masks[w] = ((base & (j > q_pos[..., None] - w)) | pad).unsqueeze(1)
        sel_t = h2d(sel, dev)
        return _Group(gather_t, sel_t, gather_t.reshape(-1)[sel_t], kv_loc, masks)

    def forward(self, layer: AttnLayer, q, k, v, fb: ForwardBatch, out: torch.Tensor | None = None) -> torch.Tensor:
        if layer.logit_softcap is not None:
            raise NotImplementedError("attention logit softcap is not supported by the torch backend")
        dv = self.pool.v[layer.kv_layer].shape[-1]
        if k is not None:
            self.pool.write(layer.kv_layer, fb.out_loc, k, v)
        meta: TorchMeta = fb.attn
        if out is None:
            out = q.new_empty(q.shape[0], q.shape[1], dv)
        q_ext = torch.cat([q, q.new_zeros(1, *q.shape[1:])])
        for g in meta.groups:
            qp = q_ext[g.gather].transpose(1, 2)  # [B, H, Q, D]
            kp, vp = self.pool.read(layer.kv_layer, g.kv_loc, q.dtype)  # [B, K, Hkv, D]
            kp, vp = kp.transpose(1, 2), vp.transpose(1, 2)
            mask = g.masks[layer.sliding_window or 0]
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, scale=layer.scaling, enable_gqa=kp.shape[1] != qp.shape[1]
            )
            o = o.transpose(1, 2).reshape(-1, q.shape[1], dv)
            out.index_copy_(0, g.tok, o[g.sel])
        return out
