"""Build the next StepPlan from the scheduler's (possibly one-step-lagged) view.

Order within a step: decode rows of running requests first (they hold memory; starving them
wastes it), then continuing prefill chunks, then new admissions, all under one token budget
(``chunk_budget``; a decode row costs T tokens). Prefill and decode share one forward, except
where ``SchedConfig.mixed_prefill`` is off (the CPU's compiled decode steps): there a step is
prefill or decode, and while both have work they alternate (``_plan_apart``).

Page reservation (docs/design.md §4.1): a decode row is planned only if the request's pages cover
``worst_len + T``, where ``worst_len`` already assumes every in-flight step accepts all T
tokens. With one step in flight that is ``committed + 2T``. When pages
run out, the newest running request is preempted (recompute); its pages come back only after
its in-flight steps return, so the planner skips rows it cannot back this step rather than
over-commit.
"""

from __future__ import annotations

import time

from proto.arrays import pack_i32
from proto.messages import AdmitRow, ExtendRow, PageAppend, StepPlan
from scheduler_proc.core import SchedulerCore, StepRecord
from scheduler_proc.pages import page_hashes
from scheduler_proc.request import Phase, Req


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _needs_every_token(req: Req) -> bool:
    """The worker must see every fill token: prompt logprobs; repetition_penalty (it marks prompt
    tokens as seen only as it computes them); frequency/presence penalties on a re-prefill (the
    fill's output tokens are counted only as computed). A prefix hit would skip them."""
    p = req.params
    return (p.prompt_logprobs >= 0 or p.repetition_penalty != 1.0
            or (req.fill_tokens is not None and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)))


def _usable_pages(req: Req, page_size: int) -> int:
    """Full pages of ``req.fill`` a prefix hit may skip. At least one token is left to compute
    (its logits give the first sample). A constrained re-prefill stops at its prompt: its fresh
    matcher replays the outputs only as the worker computes them (gpu_worker/structured/grammar.py)."""
    if _needs_every_token(req):
        return 0
    usable = (len(req.fill) - 1) // page_size
    if req.fill_tokens is not None and req.params.grammar is not None:
        usable = min(usable, len(req.prompt) // page_size)
    return usable


class Planner:
    def __init__(self, core: SchedulerCore):
        self.core = core
        self.cfg = core.cfg
        self.next_step = 1
        self._unsent_free: list[int] = []
        self._prefill_last = False  # the last plan was a prefill step (cfg.mixed_prefill off)

    def plan(self) -> StepPlan | None:
        """The next step, or None when nothing can make progress right now."""
        self._pages: list[PageAppend] = []
        self._admit: list[AdmitRow] = []
        self._extend: list[ExtendRow] = []
        self._decode: list[Req] = []
        self._rec = StepRecord(self.next_step, [])
        # Slots released since the last plan are reusable now: this plan's ``free`` list (applied
        # by the worker before ``admit``) carries them, or the next plan's if none is built.
        self.core.free_slots.extend(self.core.slots_to_free)
        self._unsent_free.extend(self.core.slots_to_free)
        self.core.slots_to_free = []
        if self.cfg.mixed_prefill:
            budget = self._plan_decode(self.cfg.chunk_budget)
            budget = self._plan_prefill_chunks(budget)
            self._plan_admissions(budget)
        else:
            self._plan_apart()
        if not (self._extend or self._decode):
            if not self.core.gate.due(bool(self.core.inflight)):
                return None
            # No rows: grammars for the worker to compile, or a question after them (the frees
            # wait for a plan with rows, which applies them before its admissions).
            plan = StepPlan(step_id=self.next_step, compile=self.core.gate.take())
        else:
            free, self._unsent_free = self._unsent_free, []
            plan = StepPlan(
                step_id=self.next_step,
                admit=self._admit,
                pages=self._pages,
                extend=self._extend,
                decode_slots=pack_i32([r.slot for r in self._decode]),
                free=free,
                compile=self.core.gate.take(),
            )
        self.next_step += 1
        self.core.inflight.append(self._rec)
        return plan

    def _plan_apart(self) -> None:
        """A prefill step or a decode step. While both have work they alternate: the step after
        a prefill step decodes, so a long prompt's chunks never hold the running requests for
        more than one step at a time."""
        for prefill in (False, True) if self._prefill_last else (True, False):
            if prefill:
                self._plan_admissions(self._plan_prefill_chunks(self.cfg.chunk_budget))
            else:
                self._plan_decode(self.cfg.chunk_budget)
            if self._extend or self._decode:
                break
        self._prefill_last = bool(self._extend)

    # ------------------------------------------------------------ decode
    def _plan_decode(self, budget: int) -> int:
        t = self.cfg.tokens_per_step
        for req in list(self.core.running):
            if req.phase is not Phase.DECODE or req.surely_done():
                continue
            if not self._grow(req, req.worst_len + t):
                continue
            req.worst_len += t
            req.decode_inflight += 1
            self._decode.append(req)
            self._touch(req)
            self._rec.decode.add(id(req))
            budget -= t
        return budget

    # ------------------------------------------------------------ prefill
    def _plan_prefill_chunks(self, budget: int) -> int:
        for req in self.core.running:
            if budget <= 0:
                break
            if req.phase is Phase.PREFILL and not req.prefill_done:
                budget -= self._chunk(req, budget)
        return budget

    def _chunk(self, req: Req, budget: int) -> int:
        """Plan the next prefill chunk of ``req``; returns the tokens used (0 if no pages)."""
        start = req.prefilled
        # Prompt logprobs need every prompt token's logits in one forward: never split.
        n = len(req.fill) - start if req.params.prompt_logprobs >= 0 else min(budget, len(req.fill) - start)
        if n <= 0 or not self._grow(req, start + n, preempt=False):
            return 0
        end = start + n
        sample = end == len(req.fill)
        self._extend.append(ExtendRow(req.slot, start, req.fill[start:end].tobytes(), sample))
        req.prefilled = req.worst_len = end
        if sample:
            req.phase = Phase.DECODE
        self._touch(req)
        self._rec.prefill_upto[id(req)] = end
        return n

    def _plan_admissions(self, budget: int) -> None:
        core = self.core
        while budget > 0 and core.waiting and core.free_slots and self._num_active() < self.cfg.max_running:
            req = core.waiting[0]
            if req.finished:
                core.waiting.popleft()
                continue
            used = self._admit_one(req, budget)
            if used == 0:
                return
            core.waiting.popleft()
            budget -= used

    def _admit_one(self, req: Req, budget: int) -> int:
        """Admit ``req`` with its first chunk; returns the tokens used (0: not admitted)."""
        core, ps = self.core, self.cfg.page_size
        fill = req.fill
        hashes = page_hashes(fill, ps, len(fill) // ps)
        # Prompt logprobs need the whole prompt computed, so they take no cache hit; nor do
        # penalties whose worker state is built from the tokens it computes (_needs_every_token).
        matched = core.alloc.match_prefix(hashes[:_usable_pages(req, ps)])
        first = len(fill) if req.params.prompt_logprobs >= 0 else min(budget, len(fill) - len(matched) * ps)
        need = _cdiv(len(matched) * ps + first, ps) - len(matched)
        if need + self._decode_reserve() > core.alloc.available:
            core.alloc.release(matched)
            return 0
        req.slot = core.free_slots.pop()
        req.pages, req.page_hashes, req.registered_pages = matched, hashes, len(matched)
        req.prefilled = req.prefill_returned = len(matched) * ps
        if req.fill_tokens is None:  # usage counts prompt tokens: a re-prefill's hit (mostly its
            req.cached_tokens = req.prefilled  # own outputs) would exceed the prompt length
        req.phase = Phase.PREFILL
        req.first_scheduled = req.first_scheduled or time.monotonic()
        core.counters.prefix_queries += len(fill)
        core.counters.prefix_hits += req.prefilled
        core.running.append(req)
        core.by_slot[req.slot] = req
        self._admit.append(AdmitRow(req.slot, req.params, req.seed, len(req.prompt)))
        if matched:
            self._pages.append(PageAppend(req.slot, 0, pack_i32(matched)))
        return self._chunk(req, budget)

    def _decode_reserve(self) -> int:
        """Pages running decoders need for their next step: admission must leave them."""
        t2 = 2 * self.cfg.tokens_per_step
        return sum(
            max(0, _cdiv(r.worst_len + t2, self.cfg.page_size) - len(r.pages))
            for r in self.core.running
            if r.phase is Phase.DECODE
        )

    # ------------------------------------------------------------ pages
    def _grow(self, req: Req, length: int, preempt: bool = True) -> bool:
        """Make ``req``'s pages cover ``length`` tokens, preempting newer requests if needed."""
        need = _cdiv(length, self.cfg.page_size) - len(req.pages)
        if need <= 0:
            return True
        alloc = self.core.alloc
        while need > alloc.available:
            if not preempt or not self._preempt_newest(protect=req, need=need):
                return False
        pages = alloc.allocate(need)
        self._pages.append(PageAppend(req.slot, len(req.pages), pack_i32(pages)))
        req.pages.extend(pages)
        return True

    def _preempt_newest(self, protect: Req, need: int) -> bool:
        """Preempt one request; True if pages became available *now*."""
        draining = sum(len(r.pages) for r in self.core.running if r.phase is Phase.DRAINING)
        if self.core.alloc.available + draining >= need:
            return False  # pages are coming back with the in-flight results; wait for them
        for victim in reversed(self.core.running):
            if victim.phase is Phase.DRAINING or id(victim) in self._rec.ids:
                continue
            # FCFS: the newest request yields, even when it is the one asking for pages.
            self.core.preempt(victim)
            return victim is not protect and victim.phase is not Phase.DRAINING
        return False

    def _touch(self, req: Req) -> None:
        if id(req) not in self._rec.ids:
            self._rec.ids.add(id(req))
            self._rec.reqs.append(req)
            req.inflight += 1

    def _num_active(self) -> int:
        return sum(1 for r in self.core.running if r.phase is not Phase.DRAINING)
