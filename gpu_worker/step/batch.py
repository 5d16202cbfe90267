"""A plan's rows on the host (``PlanRows``), and the forward batches of an eager step (no host sync).

Token layout, row-contiguous: every extend row's chunk, then every decode row's T tokens
(T = 1 plain; with MTP the bonus followed by S drafts). Decode rows take their tokens and
positions from per-slot device state, so the scheduler never sends them (docs/design.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from gpu_worker.attention.base import RowLayout
from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.step.slots import SlotState
from proto.arrays import view_i32
from proto.messages import StepPlan


# Shared by every decode-only step's PlanRows: read-only, so no step can write into another's.
_NO_I64 = np.zeros(0, dtype=np.int64)
_NO_BOOL = np.zeros(0, dtype=bool)
_NO_I64.flags.writeable = False
_NO_BOOL.flags.writeable = False


@dataclass
class PlanRows:
    """Host-side description of a plan's rows."""

    ext_slots: np.ndarray  # [E]
    ext_start: np.ndarray  # [E]
    ext_len: np.ndarray  # [E]
    ext_sample: np.ndarray  # [E] bool
    ext_tokens: np.ndarray  # concatenated chunks
    dec_slots: np.ndarray  # [D]
    _result: np.ndarray | None = field(default=None, repr=False, compare=False)

    @staticmethod
    def from_plan(plan: StepPlan) -> "PlanRows":
        ext = plan.extend
        if not ext:  # a decode-only step (most): no extend arrays to build
            return PlanRows(_NO_I64, _NO_I64, _NO_I64, _NO_BOOL, _NO_I64, view_i32(plan.decode_slots).astype(np.int64))
        toks = [view_i32(r.token_ids) for r in ext]
        return PlanRows(
            ext_slots=np.array([r.slot for r in ext], dtype=np.int64),
            ext_start=np.array([r.start for r in ext], dtype=np.int64),
            ext_len=np.array([len(t) for t in toks], dtype=np.int64),
            ext_sample=np.array([r.sample for r in ext], dtype=bool),
            ext_tokens=np.concatenate(toks).astype(np.int64) if toks else np.zeros(0, np.int64),
            dec_slots=view_i32(plan.decode_slots).astype(np.int64),
        )

    @property
    def num_ext_tokens(self) -> int:
        return int(self.ext_len.sum())

    def q_lens(self, t: int) -> np.ndarray:
        return np.concatenate([self.ext_len, np.full(len(self.dec_slots), t, dtype=np.int64)])

    @property
    def decode_only(self) -> bool:
        return len(self.ext_slots) == 0 and len(self.dec_slots) > 0

    def sampled_ext_rows(self) -> np.ndarray:
        return np.nonzero(self.ext_sample)[0]

    def result_slots(self) -> np.ndarray:
        """Row order of the StepResult: sampled extend rows, then decode rows (made once)."""
        if self._result is None:
            self._result = self.dec_slots if not len(self.ext_slots) else np.concatenate(
                [self.ext_slots[self.ext_sample], self.dec_slots])
        return self._result


def build_target_batch(inp, state: SlotState, backend, windows: tuple[int, ...], t: int,
                       dec_tokens: torch.Tensor | None) -> ForwardBatch:
    """The target forward of an ``EagerStep`` (``inputs.py``; its staged arrays on the device).
    ``dec_tokens`` [D, t]: bonus (+ drafts) per decode row, already on the device."""
    rows = inp.rows
    dev, ps = state.device, backend.pool.page_size
    d, e = len(rows.dec_slots), len(rows.ext_slots)
    dec_start = state.seq_len[inp.slots[e:]]
    dec_pos = (dec_start[:, None] + torch.arange(t, device=dev)[None, :]).reshape(-1)
    input_ids = torch.cat([inp.ext.ids, dec_tokens.reshape(-1)]) if d else inp.ext.ids
    positions = torch.cat([inp.ext.pos, dec_pos])
    out_loc = state.page_table[inp.tok_slot, positions // ps].long() * ps + positions % ps
    q_lens = rows.q_lens(t)
    kv_bound = np.concatenate([rows.ext_start + rows.ext_len, state.num_pages[rows.dec_slots] * ps])
    layout = RowLayout(slots=inp.slots, q_lens=q_lens, kv_lens=torch.cat([inp.ext.kv_len, dec_start + t]),
                       kv_bound=kv_bound, q_pos=positions)
    return ForwardBatch(input_ids, positions, out_loc, backend.build(layout, windows, inp.attn), int(q_lens.sum()))


def build_draft_batch(dec_slots_t: torch.Tensor, dec_slots: np.ndarray, state: SlotState, backend,
                      windows: tuple[int, ...], rope_offset: int) -> ForwardBatch:
    """Q-only forward over exactly the committed keys [0, seq_len) of each decode row."""
    ps = backend.pool.page_size
    kv_lens = state.seq_len[dec_slots_t]
    layout = RowLayout(
        slots=dec_slots_t,
        q_lens=np.ones(len(dec_slots), dtype=np.int64),
        kv_lens=kv_lens,
        kv_bound=state.num_pages[dec_slots] * ps,
        q_pos=kv_lens - 1,
    )
    positions = kv_lens + rope_offset
    return ForwardBatch(None, positions, None, backend.build(layout, windows), len(dec_slots))


def logits_rows(rows: PlanRows, t: int) -> np.ndarray:
    """Token indices whose logits are needed: last token of sampled chunks, all decode tokens."""
    ends = np.cumsum(rows.ext_len) - 1
    dec0 = rows.num_ext_tokens
    return np.concatenate([ends[rows.ext_sample], dec0 + np.arange(len(rows.dec_slots) * t)]).astype(np.int64)
