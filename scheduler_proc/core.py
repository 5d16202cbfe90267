"""Scheduler state and result processing (CPU only).

Lifecycle of a request and who releases what:

    WAITING --admit--> PREFILL --last chunk planned--> DECODE --finish/abort/preempt--> DRAINING
    DRAINING --(inflight == 0)--> released: pages back to the allocator, slot to ``slots_to_free``
                                  (sent in the next plan's ``free``), or requeued if preempted

A request that finished in step N is usually already part of in-flight step N+1: its N+1 tokens
are dropped, and its slot and pages return only after result N+1, the last step that touched
them (docs/design.md §4.3). Every accepted request ends with exactly one finishing ReqOutput.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from proto.arrays import F32, I32, pack_i32, view_f32, view_i32
from proto.messages import (AbortReq, GenerateReq, Logprobs, ReqOutput, ReqTimings, SchedulerStats, StepResult,
                            WorkerReady)
from scheduler_proc.finish import apply_finish_rules
from scheduler_proc.grammar_gate import GrammarGate
from scheduler_proc.pages import PageAllocator, page_hashes
from scheduler_proc.request import Phase, Req


@dataclass(frozen=True)
class SchedConfig:
    page_size: int
    num_pages: int
    max_slots: int
    tokens_per_step: int
    max_context: int
    chunk_budget: int
    max_running: int
    eos_ids: frozenset[int]
    spec_steps: int = 0
    enable_prefix_cache: bool = True
    max_queued: int = 1 << 30
    vocab_size: int = 0  # 0: unknown (tests); ids are then not range-checked here
    # --random-seed: seeds the draw of unseeded requests' seeds, so a server started with the same
    # seed samples the same answers for the same requests in the same arrival order, however
    # they are batched (every row samples from its own seeded stream). None: fresh entropy.
    random_seed: int | None = None
    mixed_prefill: bool = True  # prefill rides in decode steps; off: steps of its own (WorkerReady's word)

    @staticmethod
    def from_ready(ready: WorkerReady, args) -> "SchedConfig":
        default_chunk = 2048 if ready.device == "cpu" else 8192
        return SchedConfig(
            page_size=ready.page_size,
            num_pages=ready.num_pages,
            max_slots=ready.max_slots,
            tokens_per_step=ready.tokens_per_step,
            max_context=ready.max_context,
            chunk_budget=args.chunked_prefill_size or default_chunk,
            max_running=min(args.max_running_requests or ready.max_slots, ready.max_slots),
            eos_ids=frozenset(ready.eos_token_ids),
            spec_steps=ready.speculative_num_steps,
            enable_prefix_cache=not args.disable_prefix_cache,
            max_queued=args.max_queued_requests,
            vocab_size=ready.vocab_size,
            random_seed=args.random_seed,
            mixed_prefill=ready.mixed_prefill,
        )


@dataclass
class StepRecord:
    """What the scheduler remembers of an in-flight step until its result returns."""

    step_id: int
    reqs: list[Req]  # every request the step touches
    ids: set[int] = field(default_factory=set)  # their ids (membership without a list scan)
    decode: set[int] = field(default_factory=set)  # ids of reqs with a decode row
    prefill_upto: dict[int, int] = field(default_factory=dict)  # id(req) -> prefilled after plan

    def __post_init__(self) -> None:
        self.ids = self.ids | {id(r) for r in self.reqs}


@dataclass
class Counters:
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    steps: int = 0
    received: int = 0  # GenerateReqs read (the front's admission counts what is still in transit)
    busy_s: float = 0.0
    forward_s: float = 0.0
    draft_s: float = 0.0
    worker_busy_s: float = 0.0
    worker_gap_s: float = 0.0
    # Decode-only steps (no prefill chunk): the figures a step roofline is compared against.
    decode_steps: int = 0
    decode_busy_s: float = 0.0
    decode_tokens: int = 0  # tokens they emitted
    decode_ctx_tokens: int = 0  # sum over their rows of the context each row attends over
    per_pos: list[int] = field(default_factory=list)


class SchedulerCore:
    def __init__(self, cfg: SchedConfig):
        self.cfg = cfg
        self.alloc = PageAllocator(cfg.num_pages, cfg.page_size, cfg.enable_prefix_cache)
        self.free_slots: list[int] = list(range(cfg.max_slots, 0, -1))
        self.slots_to_free: list[int] = []
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # holds a slot, in admission order
        self.by_rid: dict[str, Req] = {}
        self.by_slot: dict[int, Req] = {}
        self.inflight: deque[StepRecord] = deque()
        self.gate = GrammarGate()  # structured-output requests until their grammar compiled
        self.outbox: list[ReqOutput] = []
        self.counters = Counters(per_pos=[0] * max(cfg.spec_steps, 0))
        self._prev_step_reqs: set[int] = set()
        self._rng = np.random.default_rng(cfg.random_seed)

    # ------------------------------------------------------------ requests
    def add_request(self, msg: GenerateReq) -> None:
        self.counters.received += 1
        prompt = view_i32(msg.prompt_ids).copy()
        if msg.rid in self.by_rid:
            return self._reject(msg.rid, len(prompt), f"duplicate request id {msg.rid!r}", 400)
        if len(prompt) == 0 or len(prompt) >= self.cfg.max_context:
            return self._reject(
                msg.rid,
                len(prompt),
                f"prompt has {len(prompt)} tokens; this model's context length is {self.cfg.max_context}",
                400,
            )
        bad = _out_of_vocab(prompt, msg.params.stop_token_ids, self.cfg.vocab_size)
        if bad is not None:
            return self._reject(msg.rid, len(prompt), bad, 400)
        # The front admits against --max-queued-requests (docs/design.md §8); this is only a backstop
        # against another client of the requests channel. Preempted requests also wait, hence
        # the running allowance.
        if len(self.waiting) + len(self.gate) >= self.cfg.max_queued + self.cfg.max_running:
            return self._reject(msg.rid, len(prompt), "server overloaded: too many queued requests", 503)
        room = self.cfg.max_context - len(prompt)
        req = Req(msg.rid, prompt, msg.params, msg.arrival, max(1, min(msg.params.max_new_tokens, room)))
        req.seed = msg.params.seed if msg.params.seed is not None else int(self._rng.integers(1 << 62))
        p = msg.params
        req.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.cfg.eos_ids)
        self.by_rid[msg.rid] = req
        if p.grammar is not None:
            self.gate.hold(req)  # queued once compiled (grammar_gate.py)
        else:
            self.waiting.append(req)

    def _count_decode_step(self, rec: StepRecord, busy_s: float, accept: list[int]) -> None:
        c = self.counters
        c.decode_steps += 1
        c.decode_busy_s += busy_s
        c.decode_tokens += sum(accept)
        # When step N's result arrives, step N-1's tokens are emitted: a row attends over the
        # prompt, the outputs (the last is the bonus token this step feeds) and its S drafts.
        drafts = self.cfg.tokens_per_step - 1
        c.decode_ctx_tokens += sum(len(r.prompt) + len(r.output_ids) + drafts for r in rec.reqs)

    def _reject(self, rid: str, n_prompt: int, message: str, code: int) -> None:
        self.outbox.append(
            ReqOutput(rid, b"", finish_reason="error", error=message, error_code=code, prompt_tokens=n_prompt)
        )

    def abort(self, msg: AbortReq) -> None:
        req = self.by_rid.get(msg.rid)
        if req is None or req.finished:
            return
        if req.phase is Phase.WAITING and not self.gate.drop(req):  # (held: not queued yet)
            self.waiting.remove(req)
        self._finish(req, "abort")

    # ------------------------------------------------------------ results
    def on_result(self, res: StepResult) -> None:
        rec = self.inflight.popleft()
        assert rec.step_id == res.step_id, f"result {res.step_id} != expected {rec.step_id}"
        for req, error in self.gate.answered(res.compiled):
            if error:
                self._finish(req, "error", error=error)
            else:
                self.waiting.append(req)
        if not rec.reqs:  # a plan that only handed over or asked after grammars
            return
        self.counters.steps += 1
        self.counters.forward_s += res.forward_s
        self.counters.draft_s += res.draft_s
        self.counters.worker_busy_s += res.busy_s
        # A gap counts as idle only when this step continues work the previous one carried: the
        # time an empty engine waits for requests is not overhead.
        if not rec.ids.isdisjoint(self._prev_step_reqs):
            self.counters.worker_gap_s += res.gap_s
        self._prev_step_reqs = rec.ids
        slots = view_i32(res.slots).tolist()
        t = self.cfg.tokens_per_step
        tokens = view_i32(res.tokens).tolist()  # [rows * t]; row r's are [r * t, r * t + accept)
        accept = view_i32(res.accept_lens).tolist()
        assert len(tokens) == len(slots) * t and len(accept) == len(slots), "malformed step result"
        if rec.reqs and len(rec.decode) == len(rec.reqs):
            self._count_decode_step(rec, res.busy_s, accept)
        now = time.monotonic()
        for plr in res.prompt_logprobs:
            req = self.by_slot[plr.slot]
            if not req.finished and req.fill_tokens is None:  # a re-prefill does not resend them
                self.outbox.append(ReqOutput(req.rid, b"", prompt_logprobs=plr.logprobs))
        for err in res.errors:  # before the rows: the failed request's tokens are dropped
            req = self.by_slot[err.slot]
            if not req.finished:
                self._finish(req, "error", error=err.message)
        for row, slot in enumerate(slots):
            req = self.by_slot[slot]
            n = accept[row]
            if id(req) in rec.decode:
                req.worst_len -= t - n
                self._spec_stats(req, n)
            if not req.finished:
                self._emit(req, tokens[row * t: row * t + n], res, row, now)
        for req in rec.reqs:
            req.inflight -= 1
            if id(req) in rec.decode:
                req.decode_inflight -= 1
            if id(req) in rec.prefill_upto:
                req.prefill_returned = rec.prefill_upto[id(req)]
                self._register_written_pages(req)
            if req.phase is Phase.DRAINING and req.inflight == 0:
                self._release(req)

    def _spec_stats(self, req: Req, accept_len: int) -> None:
        if self.cfg.spec_steps <= 0:
            return
        req.verify_ct += 1
        c = self.counters
        c.drafts += 1
        c.draft_tokens += self.cfg.spec_steps
        c.accepted += accept_len - 1
        for pos in range(accept_len - 1):
            c.per_pos[pos] += 1

    def _emit(self, req: Req, new: list[int], res: StepResult, row: int, now: float) -> None:
        p = req.params
        cut = apply_finish_rules(new, len(req.output_ids), req.stop_ids, p.min_new_tokens, req.max_new_tokens)
        kept = new[: cut.keep]
        req.output_ids.extend(kept)
        req.first_token = req.first_token or now
        req.last_token = now
        lp = _slice_logprobs(res.logprobs, row, self.cfg.tokens_per_step, cut.keep, p.logprobs)
        if cut.reason is None:
            self.outbox.append(self._output(req, kept, lp))
        else:
            self._finish(req, cut.reason, kept, lp, cut.matched)

    def _output(self, req: Req, kept: list[int], lp=None, **kw) -> ReqOutput:
        return ReqOutput(
            req.rid,
            pack_i32(kept),
            prompt_tokens=len(req.prompt),
            cached_tokens=req.cached_tokens,
            spec_verify_ct=req.verify_ct,
            logprobs=lp,
            **kw,
        )

    def _finish(self, req: Req, reason: str, kept=(), lp=None, matched=None, error: str | None = None) -> None:
        """``error``: a request the worker refused (a bad grammar), HTTP 400 before any token."""
        req.finish_reason = reason
        # The front frees the rid on this output: it may come back at once (user rids on
        # /generate) while this request still drains; only by_slot/running track it from now.
        if self.by_rid.get(req.rid) is req:
            del self.by_rid[req.rid]
        err = {} if error is None else {"error": error, "error_code": 400}
        self.outbox.append(self._output(req, list(kept), lp, finish_reason=reason, matched_stop=matched,
                                        timings=_timings(req), **err))
        if req.phase is Phase.WAITING:
            req.phase = Phase.DONE
            return
        req.phase = Phase.DRAINING
        if req.inflight == 0:
            self._release(req)

    def preempt(self, req: Req) -> None:
        """Recompute later: fold outputs into the re-prefill, free everything once drained."""
        self.counters.preemptions += 1
        req.requeue = True
        req.phase = Phase.DRAINING
        if req.inflight == 0:
            self._release(req)

    def _register_written_pages(self, req: Req) -> None:
        """Publish full prompt pages as soon as the chunk that wrote them has returned."""
        n = min(req.prefill_returned // self.cfg.page_size, len(req.page_hashes))
        if n > req.registered_pages:
            self.alloc.register(req.pages[:n], req.page_hashes[:n])
            req.registered_pages = n

    def _release(self, req: Req) -> None:
        self._cache_committed(req)
        self.alloc.release(req.pages)
        self.running.remove(req)
        del self.by_slot[req.slot]
        self.slots_to_free.append(req.slot)
        req.pages, req.page_hashes, req.registered_pages = [], [], 0
        if req.requeue and not req.finished:
            req.requeue, req.phase, req.slot = False, Phase.WAITING, 0
            req.fill_tokens = np.concatenate([req.prompt, np.asarray(req.output_ids, dtype=np.int32)])
            req.prefilled, req.prefill_returned, req.worst_len = 0, 0, 0
            self.waiting.appendleft(req)
        else:
            req.phase = Phase.DONE

    def _cache_committed(self, req: Req) -> None:
        """On release, publish the full pages of the committed sequence (prompt + outputs but
        the last token, whose KV is never written)."""
        if not self.cfg.enable_prefix_cache or req.prefill_returned < len(req.fill) or not req.output_ids:
            return
        seq = np.concatenate([req.prompt, np.asarray(req.output_ids, dtype=np.int32)])[:-1]
        n = min(len(seq) // self.cfg.page_size, len(req.pages))
        if n > req.registered_pages:
            self.alloc.register(req.pages[:n], page_hashes(seq, self.cfg.page_size, n))

    # ------------------------------------------------------------ stats
    def stats(self) -> SchedulerStats:
        c = self.counters
        return SchedulerStats(
            num_running=sum(1 for r in self.running if not r.finished),
            num_waiting=len(self.waiting) + len(self.gate),
            kv_pages_used=self.alloc.used,
            kv_pages_total=self.alloc.total,
            prefix_queries=c.prefix_queries,
            prefix_hits=c.prefix_hits,
            num_preemptions=c.preemptions,
            spec_num_drafts=c.drafts,
            spec_num_draft_tokens=c.draft_tokens,
            spec_num_accepted_tokens=c.accepted,
            spec_accepted_per_pos=tuple(c.per_pos),
            steps=c.steps,
            requests_received=c.received,
            num_slots_held=len(self.running),
            step_time_s=c.busy_s,
            worker_forward_s=c.forward_s,
            worker_draft_s=c.draft_s,
            worker_busy_s=c.worker_busy_s,
            worker_gap_s=c.worker_gap_s,
            decode_steps=c.decode_steps,
            decode_busy_s=c.decode_busy_s,
            decode_tokens=c.decode_tokens,
            decode_ctx_tokens=c.decode_ctx_tokens,
        )

    def take_outputs(self) -> list[ReqOutput]:
        out, self.outbox = self.outbox, []
        return out

    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.inflight and not self.gate


def _out_of_vocab(prompt: np.ndarray, stop_ids, vocab: int) -> str | None:
    """The worker indexes embeddings and logits with these ids: refuse any outside the vocab
    here too, whatever the front checked (defence in depth: a bad id must not kill the worker)."""
    if vocab <= 0:
        return None
    if len(prompt) and (int(prompt.min()) < 0 or int(prompt.max()) >= vocab):
        return f"prompt token ids must be in [0, {vocab})"
    if any(not 0 <= t < vocab for t in stop_ids):
        return f"stop_token_ids must be in [0, {vocab})"
    return None


def _timings(req: Req) -> ReqTimings:
    start = req.first_scheduled or req.received
    first = req.first_token or start
    return ReqTimings(start - req.received, first - start, (req.last_token or first) - first)


def _slice_logprobs(lp: Logprobs | None, row: int, t: int, keep: int, k: int) -> Logprobs | None:
    if lp is None or k < 0 or keep == 0:
        return None
    lo, hi = row * t, row * t + keep
    tok = view_f32(lp.token_logprobs)[lo:hi]
    top = min(k, lp.top)
    if top == 0:
        return Logprobs(tok.tobytes())
    ids = view_i32(lp.top_ids).reshape(-1, lp.top)[lo:hi, :top]
    lps = view_f32(lp.top_logprobs).reshape(-1, lp.top)[lo:hi, :top]
    return Logprobs(tok.tobytes(), np.ascontiguousarray(ids, I32).tobytes(),
                    np.ascontiguousarray(lps, F32).tobytes(), top)
