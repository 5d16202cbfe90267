"""Per-slot device state (docs/design.md §3), relayed between steps by slot id, never by batch row.

Row 0 of every table is the padding row. For a slot holding a request:

    seq_len[s]     committed KV length: tokens whose KV is written and accepted (truth lives
                   here; the scheduler's view lags by up to one step)
    last_token[s]  the token sampled last (the "bonus"): emitted, its KV not yet written
    hidden[s]      target post-norm hidden at position seq_len-1 (the MTP draft seed)
    page_table[s]  page ids; column c backs positions [c*page_size, (c+1)*page_size)

A slot's rows are rewritten on admit; ``free`` only clears host-side bookkeeping. Both happen
at the start of a plan, i.e. after the result of every step that referenced the old request
(the scheduler guarantees it), so stream order makes reuse safe. Admits and page appends are
staged (host mirrors at once, device rows from the step's one upload, ``upload.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.upload import staged
from proto.arrays import view_i32
from proto.messages import AdmitRow, PageAppend, SamplingParams


@dataclass
class AdmittedRows:
    """The sampling state of the requests a step admits, one row per slot (staged)."""

    slot: torch.Tensor = staged()
    seed: torch.Tensor = staged()
    temperature: torch.Tensor = staged()
    top_p: torch.Tensor = staged()
    top_k: torch.Tensor = staged()
    min_p: torch.Tensor = staged()


@dataclass
class PageWrites:
    """Page-table entries a step appends: ``page_table[rows, cols] = vals`` (staged)."""

    rows: torch.Tensor = staged()
    cols: torch.Tensor = staged()
    vals: torch.Tensor = staged()


class SlotState:
    def __init__(self, max_slots: int, max_pages: int, hidden_size: int, device, dtype):
        n = max_slots + 1
        self.device = device
        self.page_table = torch.zeros(n, max_pages, dtype=torch.int32, device=device)
        self.seq_len = torch.zeros(n, dtype=torch.int64, device=device)
        self.last_token = torch.zeros(n, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.seed = torch.zeros(n, dtype=torch.int64, device=device)
        self.temperature = torch.ones(n, dtype=torch.float32, device=device)
        self.top_p = torch.ones(n, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(n, dtype=torch.int64, device=device)
        self.min_p = torch.zeros(n, dtype=torch.float32, device=device)
        # Host mirrors: what the worker knows without asking the device.
        self.num_pages = np.zeros(n, dtype=np.int64)
        # seq_len as the host sees it: exact without MTP (a step adds one token per row); with
        # MTP a lower bound (accept counts arrive a step later). See ``advance_host``.
        self.seq_host = np.zeros(n, dtype=np.int64)
        self.greedy = np.ones(n, dtype=bool)
        self.filtered = np.zeros(n, dtype=bool)  # needs top-k / top-p / min-p
        self.logprobs = np.full(n, -1, dtype=np.int64)
        self.prompt_logprobs = np.full(n, -1, dtype=np.int64)
        self.params: dict[int, SamplingParams] = {}

    def free(self, slots: list[int]) -> None:
        if not slots:  # most steps
            return
        for s in slots:
            self.params.pop(s, None)
        self.num_pages[slots] = 0

    def stage_admit(self, rows: list[AdmitRow]) -> AdmittedRows | None:
        """Host mirrors now; the device rows are written by ``apply_admit`` after the upload."""
        if not rows:
            return None
        p = [r.params for r in rows]
        slots = np.array([r.slot for r in rows], dtype=np.int64)
        staged_rows = AdmittedRows(
            slot=slots,
            seed=np.array([r.seed & ((1 << 62) - 1) for r in rows], dtype=np.int64),
            temperature=np.array([x.temperature for x in p], dtype=np.float64),
            top_p=np.array([x.top_p for x in p], dtype=np.float64),
            # top_k has no upper bound on the wire (up to 2**64-1); beyond the vocabulary it
            # filters nothing, so clamp it: an int64 overflow here would kill the worker.
            top_k=np.array([min(x.top_k, 1 << 62) for x in p], dtype=np.int64),
            min_p=np.array([x.min_p for x in p], dtype=np.float64))
        self.num_pages[slots] = 0
        self.seq_host[slots] = 0
        self.greedy[slots] = [x.greedy for x in p]
        self.filtered[slots] = [x.top_k > 0 or x.top_p < 1.0 or x.min_p > 0.0 for x in p]
        self.logprobs[slots] = [x.logprobs for x in p]
        self.prompt_logprobs[slots] = [x.prompt_logprobs for x in p]
        self.params.update((r.slot, r.params) for r in rows)
        return staged_rows

    def apply_admit(self, a: AdmittedRows | None) -> None:
        if a is None:
            return
        idx = a.slot
        self.seed[idx] = a.seed
        self.temperature[idx] = a.temperature.float()
        self.top_p[idx] = a.top_p.float()
        self.top_k[idx] = a.top_k
        self.min_p[idx] = a.min_p.float()
        self.seq_len.index_fill_(0, idx, 0)  # a scalar assignment would sync the host

    def advance_host(self, rows) -> None:
        """After a step is staged (``batch.PlanRows``): prefilled rows hold their chunk's end,
        decode rows one more."""
        if len(rows.ext_slots):
            self.seq_host[rows.ext_slots] = rows.ext_start + rows.ext_len
        self.seq_host[rows.dec_slots] += 1

    def stage_pages(self, appends: list[PageAppend]) -> PageWrites | None:
        if not appends:
            return None
        pages = [view_i32(a.pages) for a in appends]
        rows = np.concatenate([np.full(len(p), a.slot, dtype=np.int64) for a, p in zip(appends, pages)])
        cols = np.concatenate([a.first_col + np.arange(len(p)) for a, p in zip(appends, pages)])
        np.maximum.at(self.num_pages, rows, cols + 1)
        return PageWrites(rows=rows, cols=cols, vals=np.concatenate(pages))

    def apply_pages(self, w: PageWrites | None) -> None:
        if w is not None:
            flat = w.rows * self.page_table.shape[1] + w.cols
            self.page_table.view(-1).index_copy_(0, flat, w.vals.to(torch.int32))
