"""One step of the worker: plan in, launched device work out, result copied back async.

``launch(plan)`` enqueues everything for the step on the current stream and returns a
``Pending`` whose host buffers fill once its copy event fires; step N+1 can be launched
before step N's event (it reads N's outputs from slot state, ordered by the stream).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.batch import PlanRows, build_draft_batch, build_target_batch, logits_rows
from gpu_worker.processors import LogitProcessors
from gpu_worker.prompt_logprobs import prompt_logprob_rows
from gpu_worker.sampling import RowSampling, sample, token_logprobs
from gpu_worker.device import h2d
from gpu_worker.slots import SlotState
from gpu_worker.spec import DRAFT_ROPE_OFFSET, draft_chain, verify
from proto.messages import Logprobs, StepPlan, StepResult


@dataclass
class Pending:
    step_id: int
    slots: np.ndarray
    tokens: torch.Tensor  # host [R, T] int32
    accept: torch.Tensor  # host [R] int32
    logprobs: tuple | None
    prompt_lps: list
    event: object
    timer: "StepTimer"

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def result(self) -> StepResult:
        if self.event is not None:
            self.event.synchronize()
        lp = None
        if self.logprobs is not None:
            chosen, ids, vals = (x.numpy() if x is not None else None for x in self.logprobs)
            top = 0 if ids is None else ids.shape[-1]
            lp = Logprobs(chosen.tobytes(), b"" if ids is None else ids.tobytes(),
                          b"" if vals is None else vals.tobytes(), top)
        fwd, drf = self.timer.elapsed()
        return StepResult(self.step_id, self.slots.astype(np.int32).tobytes(), self.tokens.numpy().tobytes(),
                          self.accept.numpy().tobytes(), lp, self.prompt_lps, fwd, drf)


class StepTimer:
    """Draft and forward time: CUDA events on GPU (read after the step's event), wall on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def elapsed(self) -> tuple[float, float]:
        """(forward_s, draft_s) from marks [start, after_draft, after_forward]."""
        if len(self.marks) < 3:
            return 0.0, 0.0
        a, b, c = self.marks[:3]
        if self.cuda:
            return b.elapsed_time(c) / 1e3, a.elapsed_time(b) / 1e3
        return c - b, b - a


class ModelRunner:
    def __init__(self, target, assistant, backend, state: SlotState, tokens_per_step: int, device,
                 eos_ids: tuple[int, ...] = ()):
        self.target = target
        self.proc = LogitProcessors(state.seq_len.shape[0], target.vocab_size, device, eos_ids)
        self.assistant = assistant
        self.backend = backend
        self.state = state
        self.t = tokens_per_step
        self.device = device
        self.windows = tuple(sorted(set(target.sliding_windows) | set(getattr(assistant, "sliding_windows", ()))))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Pending:
        st = self.state
        st.free(plan.free)
        st.admit(plan.admit)
        self.proc.admit(plan.admit)
        st.append_pages(plan.pages)
        rows = PlanRows.from_plan(plan)
        self.proc.observe_extend(rows)
        timer = StepTimer(self.device)
        timer.mark()
        dec_slots_t = h2d(rows.dec_slots, self.device)
        dec_tokens = self._decode_tokens(rows, dec_slots_t)
        timer.mark()
        fb = build_target_batch(rows, st, self.backend, self.windows, self.t, dec_tokens)
        hidden = self.target.forward(fb, self.backend)
        sel_hidden = hidden[h2d(logits_rows(rows, self.t), self.device)]
        logits = self.target.compute_logits(sel_hidden)
        out, accept, seed_rows = self._sample(rows, logits, fb, dec_slots_t, dec_tokens)
        prompt_lps = prompt_logprob_rows(self.target, rows, st, hidden)
        timer.mark()
        self._update_state(rows, out, accept, sel_hidden[seed_rows])
        res_slots = rows.result_slots()
        self.proc.observe_outputs(res_slots, h2d(res_slots, self.device), out, accept)
        lps = self._logprobs(rows, logits, out)
        return self._copy_out(plan.step_id, rows, out, accept, lps, prompt_lps, timer)

    # ------------------------------------------------------------ pieces
    def _decode_tokens(self, rows: PlanRows, dec_slots_t: torch.Tensor) -> torch.Tensor | None:
        if len(rows.dec_slots) == 0:
            return None
        bonus = self.state.last_token[dec_slots_t]
        if self.assistant is None:
            return bonus[:, None]
        fb = build_draft_batch(dec_slots_t, rows.dec_slots, self.state, self.backend, self.windows, DRAFT_ROPE_OFFSET)
        drafts = draft_chain(self.assistant, self.target, self.backend, fb, bonus, self.state.hidden[dec_slots_t],
                             self.t - 1)
        return torch.cat([bonus[:, None], drafts], dim=1)

    def _row_sampling(self, slots: np.ndarray) -> RowSampling:
        st = self.state
        return RowSampling(st, h2d(slots, self.device), not bool(st.greedy[slots].all()),
                           bool(st.filtered[slots].any()))

    def _sample(self, rows: PlanRows, logits, fb, dec_slots_t, dec_tokens):
        """-> out [R, T] tokens, accept [R], and per row the logits row of its seed hidden."""
        t, e_rows = self.t, rows.sampled_ext_rows()
        e = len(e_rows)
        parts_out, parts_acc, seeds = [], [], []
        if e:
            ext_slots = rows.ext_slots[e_rows]
            pos = h2d((rows.ext_start + rows.ext_len)[e_rows], self.device)
            lg = logits[:e]
            if self.proc.active(ext_slots):
                lg = self.proc.apply(lg, ext_slots, h2d(ext_slots, self.device), pos)
            tok = sample(lg, self._row_sampling(ext_slots), pos)
            parts_out.append(torch.cat([tok[:, None], tok.new_zeros(e, t - 1)], dim=1))
            parts_acc.append(torch.ones(e, dtype=torch.int64, device=self.device))
            seeds.append(torch.arange(e, device=self.device))
        if len(rows.dec_slots):
            rs = self._row_sampling(rows.dec_slots)
            seq = self.state.seq_len[dec_slots_t]
            lg = logits[e:]
            if self.proc.active(rows.dec_slots):
                pos = (seq[:, None] + 1 + torch.arange(t, device=self.device)[None, :]).reshape(-1)
                drafts = dec_tokens[:, 1:] if self.assistant is not None else None
                lg = self.proc.apply(lg, rows.dec_slots, dec_slots_t, pos, drafts)
            if self.assistant is None:
                tok = sample(lg, rs, seq + 1)
                out, acc = tok[:, None], torch.ones_like(tok)
            else:
                out, acc = verify(lg, dec_tokens[:, 1:], rs, seq)
            parts_out.append(out)
            parts_acc.append(acc)
            seeds.append(e + torch.arange(len(rows.dec_slots), device=self.device) * t + acc - 1)
        if not parts_out:  # only non-final prefill chunks: nothing sampled this step
            z = torch.zeros(0, dtype=torch.int64, device=self.device)
            return z.view(0, t), z, z
        return torch.cat(parts_out), torch.cat(parts_acc), torch.cat(seeds)

    def _update_state(self, rows: PlanRows, out, accept, seed_hidden) -> None:
        st = self.state
        if len(rows.ext_slots):
            st.seq_len[h2d(rows.ext_slots, self.device)] = h2d(rows.ext_start + rows.ext_len, self.device)
        res_slots = h2d(rows.result_slots(), self.device)
        if len(res_slots) == 0:
            return
        e = len(rows.sampled_ext_rows())
        st.seq_len[res_slots[e:]] += accept[e:]
        final = out.gather(1, (accept - 1)[:, None]).squeeze(1)
        st.last_token[res_slots] = final
        st.hidden[res_slots] = seed_hidden.to(st.hidden.dtype)

    def _logprobs(self, rows: PlanRows, logits, out):
        slots = rows.result_slots()
        want = self.state.logprobs[slots]
        if len(slots) == 0 or want.max(initial=-1) < 0:
            return None
        e, t = len(rows.sampled_ext_rows()), self.t
        # logits rows: one per sampled extend row, t per decode row; lay out as [R, t]
        idx = np.concatenate([np.arange(e) * t, e * t + np.arange(len(rows.dec_slots) * t)])
        full = logits.new_zeros(len(slots) * t, logits.shape[-1])
        full[h2d(idx, self.device)] = logits
        return token_logprobs(full, out.reshape(-1), int(want.max()))

    def _copy_out(self, step_id, rows, out, accept, lps, prompt_lps, timer) -> Pending:
        cuda = self.device.type == "cuda"

        def d2h(x):
            if x is None:
                return None
            if not cuda:
                return x.cpu()
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            host.copy_(x, non_blocking=True)
            return host

        tokens = d2h(out.to(torch.int32))
        acc = d2h(accept.to(torch.int32))
        lp = tuple(d2h(x) for x in lps) if lps is not None else None
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        return Pending(step_id, rows.result_slots(), tokens, acc, lp, prompt_lps, event, timer)
