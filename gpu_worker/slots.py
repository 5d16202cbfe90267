"""Per-slot device state (DESIGN §3), relayed between steps by slot id, never by batch row.

Row 0 of every table is the padding row. For a slot holding a request:

    seq_len[s]     committed KV length: tokens whose KV is written and accepted (truth lives
                   here; the scheduler's view lags by up to one step)
    last_token[s]  the token sampled last (the "bonus"): emitted, its KV not yet written
    hidden[s]      target post-norm hidden at position seq_len-1 (the MTP draft seed)
    page_table[s]  page ids; column c backs positions [c*page_size, (c+1)*page_size)

A slot's rows are rewritten on admit; ``free`` only clears host-side bookkeeping. Both happen
at the start of a plan, i.e. after the result of every step that referenced the old request
(the scheduler guarantees it), so stream order makes reuse safe.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.device import h2d
from proto.arrays import view_i32
from proto.messages import AdmitRow, PageAppend, SamplingParams


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
        self.greedy = np.ones(n, dtype=bool)
        self.filtered = np.zeros(n, dtype=bool)  # needs top-k / top-p / min-p
        self.logprobs = np.full(n, -1, dtype=np.int64)
        self.prompt_logprobs = np.full(n, -1, dtype=np.int64)
        self.params: dict[int, SamplingParams] = {}

    def free(self, slots: list[int]) -> None:
        for s in slots:
            self.params.pop(s, None)
        self.num_pages[slots] = 0

    def admit(self, rows: list[AdmitRow]) -> None:
        if not rows:
            return
        idx = h2d(np.array([r.slot for r in rows], dtype=np.int64), self.device)
        p = [r.params for r in rows]
        self.seed[idx] = h2d(np.array([r.seed & ((1 << 62) - 1) for r in rows], dtype=np.int64), self.device)
        self.temperature[idx] = h2d(np.array([x.temperature for x in p], dtype=np.float32), self.device)
        self.top_p[idx] = h2d(np.array([x.top_p for x in p], dtype=np.float32), self.device)
        # top_k has no upper bound on the wire (up to 2**64-1); beyond the vocabulary it filters
        # nothing, so clamp it: an int64 overflow here killed the worker.
        self.top_k[idx] = h2d(np.array([min(x.top_k, 1 << 62) for x in p], dtype=np.int64), self.device)
        self.min_p[idx] = h2d(np.array([x.min_p for x in p], dtype=np.float32), self.device)
        self.seq_len[idx] = 0
        slots = np.array([r.slot for r in rows])
        self.num_pages[slots] = 0
        self.greedy[slots] = [x.greedy for x in p]
        self.filtered[slots] = [x.top_k > 0 or x.top_p < 1.0 or x.min_p > 0.0 for x in p]
        self.logprobs[slots] = [x.logprobs for x in p]
        self.prompt_logprobs[slots] = [x.prompt_logprobs for x in p]
        self.params.update((r.slot, r.params) for r in rows)

    def append_pages(self, appends: list[PageAppend]) -> None:
        if not appends:
            return
        pages = [view_i32(a.pages) for a in appends]
        rows = np.concatenate([np.full(len(p), a.slot) for a, p in zip(appends, pages)])
        cols = np.concatenate([a.first_col + np.arange(len(p)) for a, p in zip(appends, pages)])
        vals = np.concatenate(pages)
        self.page_table[h2d(rows, self.device), h2d(cols, self.device)] = h2d(vals, self.device)
        np.maximum.at(self.num_pages, rows, cols + 1)
