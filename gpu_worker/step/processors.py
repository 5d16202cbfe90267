"""Logit processors with per-slot device state: penalties and min_tokens (vLLM semantics).

- repetition_penalty p: for tokens seen in the prompt or the output, logit > 0 -> logit / p,
  else logit * p;
- frequency_penalty f and presence_penalty r: logit -= f * count_out(tok) + r * [count_out > 0]
  (output tokens only);
- min_tokens m: the request's stop tokens (EOS unless ignore_eos, plus stop_token_ids) get
  -inf at every position before ``prompt_len + m``;
- logit_bias: the request's biases are added to their tokens' logits first, before penalties
  (vLLM's order), so greedy rows, MTP's verify included, pick the biased argmax.

Raw logits stay untouched for logprobs. Counts live on the device, indexed by slot, and are
updated in the step that produced the tokens (stream order makes step N+1 see them). With
MTP, verify position i also counts drafts d1..di of its own row, so greedy output with
penalties is the same with and without MTP.
The penalty tables ([slots, vocab]) are allocated the first time a request asks for one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.device import h2d
from gpu_worker.upload import staged
from proto.messages import AdmitRow

STOP_WIDTH = 8  # initial width of the per-slot stop-id and logit-bias tables; they grow on demand


@dataclass
class BiasRows:
    """Logit-bias table rows to write: ``bias_ids[slot] = ids``, ``bias_vals[slot] = vals``."""

    slot: torch.Tensor = staged()
    ids: torch.Tensor = staged()  # [n, width]
    vals: torch.Tensor = staged()  # [n, width]


@dataclass
class ProcessorRows:
    """The admitted requests' processor parameters, one row per slot (staged)."""

    slot: torch.Tensor = staged()
    rep: torch.Tensor = staged()
    freq: torch.Tensor = staged()
    pres: torch.Tensor = staged()
    min_until: torch.Tensor = staged()
    stops: torch.Tensor = staged()  # [n, width]
    stop_valid: torch.Tensor = staged()  # [n, width]
    bias: BiasRows | None = staged(default=None)
    penalised: torch.Tensor | None = staged(default=None)  # slots whose counts start over


class LogitProcessors:
    def __init__(self, n_slots: int, vocab: int, device, eos_ids: tuple[int, ...]):
        self.vocab, self.device, self.eos = vocab, device, tuple(eos_ids)
        self.rep = torch.ones(n_slots, device=device)
        self.freq = torch.zeros(n_slots, device=device)
        self.pres = torch.zeros(n_slots, device=device)
        self.min_until = torch.zeros(n_slots, dtype=torch.int64, device=device)
        self.stop_ids = torch.zeros(n_slots, STOP_WIDTH, dtype=torch.int64, device=device)
        self.stop_valid = torch.zeros(n_slots, STOP_WIDTH, dtype=torch.int64, device=device)
        self.bias_ids = torch.zeros(n_slots, STOP_WIDTH, dtype=torch.int64, device=device)
        self.bias_vals = torch.zeros(n_slots, STOP_WIDTH, device=device)
        self.has_penalty = np.zeros(n_slots, dtype=bool)
        self.has_min = np.zeros(n_slots, dtype=bool)
        self.has_bias = np.zeros(n_slots, dtype=bool)
        self.prompt_len = np.zeros(n_slots, dtype=np.int64)
        self.counts: torch.Tensor | None = None  # [slots, V] int32 output-token counts
        self.prompt_seen: torch.Tensor | None = None  # [slots, V] bool

    # ------------------------------------------------------------ per-request state
    def stage_admit(self, rows: list[AdmitRow]) -> ProcessorRows | None:
        """Host flags now; device rows from ``apply_admit`` after the step's upload."""
        if not rows:
            return None
        slots = np.array([r.slot for r in rows], dtype=np.int64)
        p = [r.params for r in rows]
        pen = np.array([x.repetition_penalty != 1.0 or x.frequency_penalty != 0 or x.presence_penalty != 0 for x in p])
        self.has_penalty[slots] = pen
        self.has_min[slots] = [x.min_new_tokens > 0 for x in p]
        self.prompt_len[slots] = [r.prompt_len for r in rows]
        ids = [list(x.stop_token_ids) + ([] if x.ignore_eos else list(self.eos)) for x in p]
        width = max(self.stop_ids.shape[1], max(len(i) for i in ids))  # every stop id is masked
        self.stop_ids, self.stop_valid = _widened(self.stop_ids, width), _widened(self.stop_valid, width)
        if pen.any():
            self._ensure_tables()
        return ProcessorRows(
            slot=slots,
            rep=np.array([x.repetition_penalty for x in p], dtype=np.float64),
            freq=np.array([x.frequency_penalty for x in p], dtype=np.float64),
            pres=np.array([x.presence_penalty for x in p], dtype=np.float64),
            min_until=np.array([r.prompt_len + x.min_new_tokens for r, x in zip(rows, p)], dtype=np.int64),
            stops=_padded(ids, width, np.int64),
            stop_valid=_padded([[1] * len(i) for i in ids], width, np.int64),
            bias=self._stage_bias(slots, p),
            penalised=slots[pen] if pen.any() else None)

    def apply_admit(self, r: ProcessorRows | None) -> None:
        if r is None:
            return
        idx = r.slot
        self.rep[idx] = r.rep.float()
        self.freq[idx] = r.freq.float()
        self.pres[idx] = r.pres.float()
        self.min_until[idx] = r.min_until
        self.stop_ids[idx] = r.stops
        self.stop_valid[idx] = r.stop_valid
        if r.bias is not None:
            self.bias_ids[r.bias.slot] = r.bias.ids
            self.bias_vals[r.bias.slot] = r.bias.vals.float()
        if r.penalised is not None:
            self.counts.index_fill_(0, r.penalised, 0)
            self.prompt_seen.index_fill_(0, r.penalised, False)

    def _stage_bias(self, slots: np.ndarray, params: list) -> BiasRows | None:
        """Bias-table rows for the admitted requests that have a bias, and zero rows for slots
        whose previous request had one. Invariant: a slot's row is all zeros (adds nothing)
        unless its current request has a bias, so ``apply`` adds every row of the batch."""
        has = np.array([len(x.logit_bias_ids) > 0 for x in params])
        write = has | self.has_bias[slots]
        self.has_bias[slots] = has
        if not write.any():
            return None
        rows = [x for x, w in zip(params, write) if w]
        width = max(self.bias_ids.shape[1], max(len(x.logit_bias_ids) for x in rows))
        self.bias_ids, self.bias_vals = _widened(self.bias_ids, width), _widened(self.bias_vals, width)
        return BiasRows(slot=slots[write], ids=_padded([x.logit_bias_ids for x in rows], width, np.int64),
                        vals=_padded([x.logit_bias for x in rows], width, np.float64))

    def _ensure_tables(self) -> None:
        if self.counts is None:
            n = self.rep.shape[0]
            self.counts = torch.zeros(n, self.vocab, dtype=torch.int32, device=self.device)
            self.prompt_seen = torch.zeros(n, self.vocab, dtype=torch.bool, device=self.device)

    def observe_extend(self, rows) -> None:
        """Prompt tokens mark ``prompt_seen``; re-prefilled output tokens (after a preemption,
        positions >= prompt_len) count as output."""
        want = self.has_penalty[rows.ext_slots] if len(rows.ext_slots) else np.zeros(0, bool)
        if not want.any():
            return
        slot_tok = np.repeat(rows.ext_slots, rows.ext_len)
        offsets = np.cumsum(rows.ext_len) - rows.ext_len
        pos = np.arange(len(slot_tok)) + np.repeat(rows.ext_start - offsets, rows.ext_len)
        keep = np.repeat(want, rows.ext_len)
        is_out = pos >= self.prompt_len[slot_tok]
        s, t = slot_tok[keep], rows.ext_tokens[keep]
        self.prompt_seen[h2d(s[~is_out[keep]], self.device), h2d(t[~is_out[keep]], self.device)] = True
        o = is_out[keep]
        if o.any():
            ones = torch.ones(int(o.sum()), dtype=torch.int32, device=self.device)
            self.counts.index_put_((h2d(s[o], self.device), h2d(t[o], self.device)), ones, accumulate=True)

    def observe_outputs(self, res_slots: np.ndarray, res_slots_t, out: torch.Tensor, accept: torch.Tensor) -> None:
        if self.counts is None or not self.has_penalty[res_slots].any():
            return
        t = out.shape[1]
        keep = (torch.arange(t, device=out.device)[None, :] < accept[:, None]).to(torch.int32)
        slots = res_slots_t[:, None].expand(-1, t)
        self.counts.index_put_((slots.reshape(-1), out.reshape(-1)), keep.reshape(-1), accumulate=True)

    # ------------------------------------------------------------ applying
    def active(self, slots: np.ndarray) -> bool:
        return bool(len(slots)) and bool(self.has_penalty[slots].any() or self.has_min[slots].any()
                                         or self.has_bias[slots].any())

    def apply(self, logits: torch.Tensor, slots: np.ndarray, slots_t, pos: torch.Tensor,
              drafts: torch.Tensor | None = None) -> torch.Tensor:
        """Processed copy of ``logits`` [R*N, V] (N positions per row, N = 1 without drafts).

        ``pos`` [R*N]: the sequence position each sampled token will occupy. ``drafts`` [R, N-1]:
        the row's own draft tokens, counted for the later positions of the same row."""
        out = logits.float().clone()
        n = 1 if drafts is None else drafts.shape[1] + 1
        rows = out.view(len(slots), n, -1)
        biased = self.has_bias[slots].any()
        if biased:  # other rows' bias rows are zeros (``_stage_bias``), as are padding entries
            out.scatter_add_(1, self.bias_ids[slots_t].repeat_interleave(n, 0),
                             self.bias_vals[slots_t].repeat_interleave(n, 0))
        if self.has_penalty[slots].any():  # penalties see the biased logits (vLLM's order)
            raw = rows.clone() if biased else logits.float().view(len(slots), n, -1)
            self._penalize(rows, raw, slots_t, drafts)
        if self.has_min[slots].any():
            self._mask_stops(out, slots_t.repeat_interleave(n), pos)
        return out

    def _penalize(self, rows, raw, slots_t, drafts) -> None:
        counts = self.counts[slots_t]  # [R, V]
        seen = self.prompt_seen[slots_t] | (counts > 0)
        rep, freq, pres = self.rep[slots_t][:, None], self.freq[slots_t][:, None], self.pres[slots_t][:, None]
        rows.copy_(_penalty(raw, counts[:, None].float(), seen[:, None], rep[:, None], freq[:, None], pres[:, None]))
        for i in range(1, rows.shape[1]):  # drafts d1..di precede verify position i
            d = drafts[:, :i]  # [R, i]
            extra = (d[:, :, None] == d[:, None, :]).sum(-1)  # occurrences of each d_j in d1..di
            c = counts.gather(1, d).float() + extra
            s = torch.ones_like(d, dtype=torch.bool)
            vals = _penalty(raw[:, i].gather(1, d), c, s, rep, freq, pres)
            rows[:, i].scatter_(1, d, vals)

    def _mask_stops(self, out, slots_rep, pos) -> None:
        active = (pos < self.min_until[slots_rep]).to(torch.int64)[:, None]
        hits = torch.zeros_like(out, dtype=torch.int64)
        hits.scatter_add_(1, self.stop_ids[slots_rep], self.stop_valid[slots_rep] * active)
        out.masked_fill_(hits > 0, float("-inf"))


def _widened(table: torch.Tensor, width: int) -> torch.Tensor:
    """A per-slot table [slots, w] with zero columns up to ``width`` (itself if wide enough)."""
    return table if width <= table.shape[1] else torch.nn.functional.pad(table, (0, width - table.shape[1]))


def _padded(rows: list, width: int, dtype) -> np.ndarray:
    """Host rows of unequal length -> [len(rows), width], zero-padded (token 0, bias 0, invalid)."""
    out = np.zeros((len(rows), width), dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def _penalty(logits, counts, seen, rep, freq, pres):
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - freq * counts - pres * (counts > 0).float()
