"""A CPU simulation of the GPU worker for scheduler tests.

Its "model" is a hash of the token ids it reads back from its own simulated paged KV pool, so a
page table pointing at the wrong page, a stale or unwritten position, or a slot reused too early
changes the tokens and the test sees it. With tokens_per_step T > 1 it simulates MTP: drafts
are right with probability ``draft_acc`` and the verify writes KV for all T positions (rejected
ones included), exactly like the real worker.
"""

from __future__ import annotations

import random

import numpy as np

from proto.arrays import pack_i32, view_i32
from proto.messages import StepPlan, StepResult

VOCAB = 64
EOS = 0


def next_token(prefix_hash: int, token: int, pos: int) -> int:
    h = (prefix_hash * 1_000_003 + token * 7919 + pos * 31) % 2_147_483_647
    tok = h % VOCAB
    # Make EOS rare-ish but present.
    return EOS if tok < 2 else tok


def seq_hash(tokens) -> int:
    h = 0
    for t in tokens:
        h = (h * 131 + int(t) + 1) % 2_147_483_647
    return h


def reference(prompt: list[int], max_new: int, eos: bool, min_new: int = 0) -> list[int]:
    seq, out = list(prompt), []
    while len(out) < max_new:
        tok = next_token(seq_hash(seq[:-1]), seq[-1], len(seq) - 1)
        out.append(tok)
        seq.append(tok)
        if eos and tok == EOS and len(out) > min_new:
            break
    return out


class SimWorker:
    def __init__(self, num_pages: int, page_size: int, max_slots: int, t: int, draft_acc: float = 0.7, seed=0):
        self.ps = page_size
        self.t = t
        self.pool = np.full(num_pages * page_size, -1, dtype=np.int64)
        self.table: dict[int, dict[int, int]] = {}
        self.seq_len: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.live: set[int] = set()
        self.max_slots = max_slots
        self.draft_acc = draft_acc
        self.rng = random.Random(seed)

    def loc(self, slot: int, pos: int) -> int:
        page = self.table[slot].get(pos // self.ps)
        assert page is not None and page > 0, f"slot {slot} position {pos} has no page"
        return page * self.ps + pos % self.ps

    def model(self, slot: int, pos: int, token: int) -> int:
        """The token after ``token`` at ``pos``, reading positions [0, pos) from the pool."""
        prefix = [self.pool[self.loc(slot, p)] for p in range(pos)]
        assert min(prefix, default=0) >= 0, f"slot {slot} reads an unwritten position below {pos}"
        return next_token(seq_hash(prefix), token, pos)

    def run(self, plan: StepPlan) -> StepResult:
        for s in plan.free:
            self.live.discard(s)
        for a in plan.admit:
            assert 1 <= a.slot <= self.max_slots and a.slot not in self.live, f"slot {a.slot} reused while live"
            self.live.add(a.slot)
            self.table[a.slot] = {}
        for pa in plan.pages:
            for i, page in enumerate(view_i32(pa.pages)):
                self.table[pa.slot][pa.first_col + i] = int(page)
        slots, toks, acc = [], [], []
        for row in plan.extend:
            ids = view_i32(row.token_ids)
            for i, tok in enumerate(ids):
                self.pool[self.loc(row.slot, row.start + i)] = tok
            end = row.start + len(ids)
            self.seq_len[row.slot] = end
            if row.sample:
                nxt = self.model(row.slot, end - 1, int(ids[-1]))
                self.last[row.slot] = nxt
                slots.append(row.slot)
                toks.append([nxt] + [0] * (self.t - 1))
                acc.append(1)
        for slot in view_i32(plan.decode_slots):
            out, a = self._decode(int(slot))
            slots.append(int(slot))
            toks.append(out)
            acc.append(a)
        return StepResult(plan.step_id, pack_i32(slots), pack_i32(np.array(toks).reshape(-1)), pack_i32(acc))

    def _decode(self, slot: int) -> tuple[list[int], int]:
        assert slot in self.live
        pos, tok = self.seq_len[slot], self.last[slot]
        inputs, truth = [tok], []
        for i in range(self.t):  # true continuation and (possibly wrong) drafts
            nxt = self._peek(slot, pos, inputs, i)
            truth.append(nxt)
            if i < self.t - 1:
                inputs.append(nxt if self.rng.random() < self.draft_acc else (nxt + 1) % VOCAB)
        for i, x in enumerate(inputs):  # verify writes KV for every input, rejected ones too
            self.pool[self.loc(slot, pos + i)] = x
        n_ok = 0
        while n_ok < self.t - 1 and inputs[n_ok + 1] == truth[n_ok]:
            n_ok += 1
        out = truth[: n_ok + 1] + [0] * (self.t - n_ok - 1)
        self.seq_len[slot] = pos + n_ok + 1
        self.last[slot] = truth[n_ok]
        return out, n_ok + 1

    def _peek(self, slot: int, pos: int, inputs: list[int], i: int) -> int:
        prefix = [self.pool[self.loc(slot, p)] for p in range(pos)] + inputs[:i]
        assert min(prefix, default=0) >= 0
        return next_token(seq_hash(prefix), inputs[i], pos + i)
