"""Token selection of a step's result rows, outside the graphs: logit processors, grammar masks,
sampling, and MTP's verify.

Result rows are the sampled extend rows (one token each), then the decode rows (T positions
each: plain decode samples one token; MTP verifies the drafts and emits the accepted ones plus
one). Selection that depends on per-request options runs here, after any graph replay, so the
graphs stay exact for every request mix.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from gpu_worker.spec.mtp import verify
from gpu_worker.step.batch import PlanRows
from gpu_worker.step.sampling import RowSampling, sample


class TokenSelector:
    def __init__(self, state, proc, grammar, t: int, mtp: bool, device):
        self.state, self.proc, self.grammar, self.t, self.mtp, self.device = state, proc, grammar, t, mtp, device
        # Set per step by the runner: returns every step in flight before the step's first
        # grammar mask (the masks need those steps' tokens).
        self.retire: Callable[[], None] | None = None

    def tokens(self, rows: PlanRows, logits: torch.Tensor, dec_slots: torch.Tensor, dec_tokens, sampled):
        """-> out [R, T] tokens, accept [R], and per row the logits row of its seed hidden.
        ``sampled``: the sampled extend rows' staged slots and positions (``inputs.SampledRows``)."""
        parts = []
        e = len(rows.sampled_ext_rows())
        if e:
            parts.append(self._extend(rows, logits[:e], sampled))
        if len(rows.dec_slots):
            parts.append(self._decode(rows, logits[e:], dec_slots, dec_tokens, e))
        if not parts:  # only non-final prefill chunks: nothing sampled this step
            z = torch.zeros(0, dtype=torch.int64, device=self.device)
            return z.view(0, self.t), z, z
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat(x) for x in zip(*parts))

    def _extend(self, rows: PlanRows, lg: torch.Tensor, sampled):
        """One token per sampled extend row (its prompt's last chunk)."""
        e, t = lg.shape[0], self.t
        slots = rows.ext_slots[rows.sampled_ext_rows()]
        raw = lg
        if self.proc.active(slots):
            lg = self.proc.apply(lg, slots, sampled.slots, sampled.pos)
        lg = self._constrain(lg, raw, slots)
        tok = sample(lg, self._row_sampling(slots, sampled.slots), sampled.pos)
        out = torch.cat([tok[:, None], tok.new_zeros(e, t - 1)], dim=1)
        return out, torch.ones(e, dtype=torch.int64, device=self.device), torch.arange(e, device=self.device)

    def _decode(self, rows: PlanRows, lg: torch.Tensor, dec_slots: torch.Tensor, dec_tokens, e: int):
        """Plain decode: one token per row. MTP: the accepted drafts, then one token."""
        t, slots = self.t, rows.dec_slots
        rs = self._row_sampling(slots, dec_slots)
        seq = self.state.seq_len[dec_slots]
        drafts = dec_tokens[:, 1:] if self.mtp else None
        raw = lg
        if self.proc.active(slots):
            pos = (seq[:, None] + 1 + torch.arange(t, device=self.device)[None, :]).reshape(-1)
            lg = self.proc.apply(lg, slots, dec_slots, pos, drafts)
        lg = self._constrain(lg, raw, slots, drafts)
        if self.mtp:
            out, acc = verify(lg, drafts, rs, seq)
        else:
            tok = sample(lg, rs, seq + 1)
            out, acc = tok[:, None], torch.ones_like(tok)
        return out, acc, e + torch.arange(len(slots), device=self.device) * t + acc - 1

    def _row_sampling(self, slots: np.ndarray, slots_t: torch.Tensor) -> RowSampling:
        st = self.state
        return RowSampling(st, slots_t, not bool(st.greedy[slots].all()), bool(st.filtered[slots].any()))

    def _constrain(self, lg, raw, slots: np.ndarray, drafts=None):
        """``lg`` with the grammar masks of the constrained rows among ``slots``. Before the
        step's first mask the steps in flight return (``retire``)."""
        if not self.grammar.active(slots):
            return lg
        if self.retire is not None:
            retire, self.retire = self.retire, None
            retire()
        return self.grammar.apply(lg, raw, slots, drafts, min_tokens=bool(self.proc.has_min[slots].any()))
