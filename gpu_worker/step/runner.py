"""One step of the worker: plan in, launched device work out, result copied back async.

``launch(plan)`` enqueues everything for the step on the current stream and returns a
``Pending`` whose host buffers fill once its copy event fires; step N+1 can be launched
before step N's event (it reads N's outputs from slot state, ordered by the stream).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from gpu_worker.step.batch import PlanRows, build_draft_batch, build_target_batch, stage_target_batch
from gpu_worker.graphs.decode import DecodeBody, DecodeGraphs
from gpu_worker.structured.grammar import GrammarRows
from gpu_worker.kernels import enable_cpu_kernels
from gpu_worker.graphs.prefill import PrefillGraphs
from gpu_worker.step.processors import LogitProcessors
from gpu_worker.step.prompt_logprobs import prompt_logprob_rows
from gpu_worker.step.sampling import RowSampling, sample, token_logprobs
from gpu_worker.settings import DevSettings
from gpu_worker.step.slots import SlotState
from gpu_worker.spec.mtp import DRAFT_ROPE_OFFSET, draft_chain, verify
from gpu_worker.step.staging import StageBatch, Staging
from gpu_worker.step.timer import StepTimer
from proto.messages import Logprobs, SlotError, StepPlan, StepResult


@dataclass
class Pending:
    step_id: int
    slots: np.ndarray
    tokens: torch.Tensor  # host [R, T] int32
    accept: torch.Tensor  # host [R] int32
    logprobs: tuple | None
    prompt_lps: list
    event: object
    timer: StepTimer
    errors: list[SlotError] = field(default_factory=list)
    on_tokens: Callable | None = None  # GrammarRows.observe, for steps with constrained rows
    compiled: list = field(default_factory=list)  # GrammarDone: grammars compiled ahead of admission

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
        fwd, drf, busy, gap = self.timer.elapsed()
        if self.on_tokens is not None:  # called once per step, in step order (the worker loop)
            self.on_tokens(self.slots, self.tokens.numpy(), self.accept.numpy())
        return StepResult(self.step_id, self.slots.astype(np.int32).tobytes(), self.tokens.numpy().tobytes(),
                          self.accept.numpy().tobytes(), lp, self.prompt_lps, fwd, drf, busy, gap, self.errors,
                          self.compiled)


def _no_tick(phase: str, step: bool = False) -> None:
    pass


class ModelRunner:
    """Launches steps. Decode-only steps whose batch fits a bucket replay CUDA graphs
    (``cuda_graphs.py``); other steps (prefill chunks) replay the piecewise prefill graphs
    (``prefill_graphs.py``) up to the step budget, eagerly beyond it. Either way the step's host
    data crosses to the device in one staged copy (``staging.py``)."""

    def __init__(self, target, assistant, backend, state: SlotState, tokens_per_step: int, device,
                 eos_ids: tuple[int, ...] = (), tokenizer_dir: str | None = None, json_any_whitespace: bool = True,
                 settings: DevSettings = DevSettings()):
        self.target = target
        self.settings = settings
        self.proc = LogitProcessors(state.seq_len.shape[0], target.vocab_size, device, eos_ids)
        self.grammar = GrammarRows(tokenizer_dir, target.vocab_size, eos_ids, device, json_any_whitespace)
        self.assistant = assistant
        self.backend = backend
        self.state = state
        self.t = tokens_per_step
        self.device = device
        self.windows = tuple(sorted(set(target.sliding_windows) | set(getattr(assistant, "sliding_windows", ()))))
        self.staging = Staging(device)
        self.copies = torch.cuda.Stream(device) if device.type == "cuda" else None  # see _copy_home
        self._copied = None  # the event of the last copy home
        self.graphs: DecodeGraphs | None = None
        self.prefill: PrefillGraphs | None = None
        self._last_timer: StepTimer | None = None
        self.tick = _no_tick  # HostClock.tick under DevSettings.host_timing (worker main)
        self._retire: Callable[[], None] | None = None  # this step's ``retire`` (``launch``)
        self.cpu_kernels = False  # CPU tensors through the Triton kernels (interpreter)
        backend.host_decode_lens = assistant is None  # see SlotState.seq_host
        backend.decode_q_lens = frozenset({1, tokens_per_step})

    def enable_graphs(self, buckets: list[int], emulate: bool = False) -> DecodeGraphs:
        """Decode steps of up to max(buckets) rows go through ``DecodeGraphs`` (captured here)."""
        enable_cpu_kernels(self.cpu_kernels)
        body = DecodeBody(self.target, self.assistant, self.backend, self.state, self.t)
        self.graphs = DecodeGraphs(body, buckets, emulate=emulate)
        self.graphs.capture()
        return self.graphs

    def enable_prefill_graphs(self, max_tokens: int, emulate: bool = False) -> PrefillGraphs:
        """Forwards of up to ``max_tokens`` tokens that are not decode-graph steps replay the
        piecewise graphs (``prefill_graphs.py``, captured here)."""
        enable_cpu_kernels(self.cpu_kernels)
        dtype = self.state.hidden.dtype  # the model's
        self.prefill = PrefillGraphs(self.target, self.backend, max_tokens, dtype, self.device, emulate=emulate)
        self.prefill.capture()
        return self.prefill

    def launch(self, plan: StepPlan, retire: Callable[[], None] | None = None) -> Pending:
        """``retire``: returns every step in flight (the caller's loop sends their results). A step
        that samples for a constrained row calls it after its forward is queued and before its
        masks are built: the masks need those steps' tokens, and the device runs this step's
        forward while the host waits (``grammar.py``). A plan with no rows only asks after
        grammars compiling ahead of admission: no device work, a short wait for one to finish."""
        self.grammar.precompile(plan.compile)
        rows = bool(plan.extend) or bool(plan.decode_slots)
        pending = self._launch(plan, retire) if rows else Pending(
            plan.step_id, np.zeros(0, np.int64), torch.zeros((0, self.t), dtype=torch.int32),
            torch.zeros(0, dtype=torch.int32), None, [], None, StepTimer(self.device, None))
        # Only a plan that just asks (nothing in flight then: the scheduler sends it so) waits a
        # little for a compile; one handing grammars over may have earlier steps to return.
        pending.compiled = self.grammar.take_compiled(0.01 if not rows and not plan.compile else 0.0)
        return pending

    @torch.inference_mode()
    def _launch(self, plan: StepPlan, retire: Callable[[], None] | None) -> Pending:
        self._retire = retire if retire is not None and self.grammar.needs_sync(plan) else None
        # Process-wide switch, set per step: several runners share one test process.
        enable_cpu_kernels(self.cpu_kernels)
        st = self.state
        rows, b, bucket = self.stage(plan)
        self.tick("l.stage")
        timer = self._last_timer = StepTimer(self.device, self._last_timer)
        timer.mark()
        st.apply_admit(b)
        self.proc.apply_admit(b)
        st.apply_pages(b)
        if bucket is not None:
            self.backend.prepare_graph(bucket, b)  # plan()-style host work, outside the graph
        self.proc.observe_extend(rows)
        self.grammar.observe_extend(rows)
        if bucket is not None and self._greedy_tail(rows, b):
            n = len(rows.dec_slots)
            self.graphs.run(n, b.extras["dec_pad"], b.get("dec_pad"), timer.mark)
            if self._copied is not None:  # the tail rewrites the buffer the last copy reads
                torch.cuda.current_stream(self.device).wait_event(self._copied)
            result = self.graphs.run_tail(n)
            self.tick("l.forward")
            timer.mark()
            return self._copy_out_result(plan.step_id, rows, result, timer)
        if bucket is not None:
            dec_tokens, hidden, logits = self.graphs.run(len(rows.dec_slots), b.extras["dec_pad"], b.get("dec_pad"),
                                                         timer.mark)
            sel_hidden = hidden
        else:
            dec_tokens = self._decode_tokens(rows, b)
            timer.mark()
            fb = build_target_batch(rows, st, self.backend, self.windows, self.t, dec_tokens, b)
            hidden = self._target_forward(fb)
            sel_hidden = hidden[b["logit_rows"]]
            logits = self.target.compute_logits(sel_hidden)
        self.tick("l.forward")
        out, accept, seed_rows = self._sample(rows, logits, b, dec_tokens)
        self.tick("l.sample")
        prompt_lps = prompt_logprob_rows(self.target, rows, st, hidden)
        timer.mark()
        self._update_state(rows, b, out, accept, sel_hidden[seed_rows])
        self.proc.observe_outputs(rows.result_slots(), self._res_slots(rows, b), out, accept)
        lps = self._logprobs(rows, b, logits, out)
        return self._copy_out(plan.step_id, rows, out, accept, lps, prompt_lps, timer)

    # ------------------------------------------------------------ pieces
    def stage(self, plan: StepPlan) -> tuple[PlanRows, StageBatch, int | None]:
        """The step's host half: slots freed, host mirrors updated, every array its device work
        reads in one upload -> (rows, the uploaded batch, the decode graph bucket or None).
        On a host-bound step this is a third of the worker's time (benchmarks/host_step_bench.py)."""
        st = self.state
        st.free(plan.free)
        self.grammar.stage(plan)  # compiles admitted requests' grammars
        rows = PlanRows.from_plan(plan)
        b = self.staging.batch()
        st.stage_admit(plan.admit, b)
        self.proc.stage_admit(plan.admit, b)
        st.stage_pages(plan.pages, b)
        bucket = self.graphs.bucket(len(rows.dec_slots)) if self.graphs is not None and rows.decode_only else None
        self._stage_rows(rows, b, bucket)
        st.advance_host(rows)
        b.upload()  # the step's one host-to-device copy
        return rows, b, bucket

    def _greedy_tail(self, rows: PlanRows, b: StageBatch) -> bool:
        """A graph step whose rows are all greedy, with no logit processors and no logprobs,
        selects its tokens and updates slot state inside the graphs (``DecodeGraphs.run_tail``)."""
        return ("lp_idx" not in b and bool(self.state.greedy[rows.dec_slots].all())
                and not self.proc.active(rows.dec_slots) and not self.grammar.active(rows.dec_slots))

    def _target_forward(self, fb) -> torch.Tensor:
        if self.prefill is not None and self.prefill.bucket(fb.num_tokens) is not None:
            return self.prefill.forward(fb)
        return self.target.forward(fb, self.backend)

    def _stage_rows(self, rows: PlanRows, b: StageBatch, bucket: int | None) -> None:
        """Every host array the step's device work reads, into the staging batch."""
        e_rows = rows.sampled_ext_rows()
        if len(e_rows):  # (read by ``_sample`` only for these rows)
            b.put("samp_ext_slots", rows.ext_slots[e_rows])
            b.put("samp_ext_pos", (rows.ext_start + rows.ext_len)[e_rows])
        res = rows.result_slots()
        # decode rows' KV lengths after this step's tokens, where the host knows them (no MTP)
        dec_kv = self.state.seq_host[rows.dec_slots] + self.t if self.assistant is None else None
        if bucket is not None:  # the result rows are the decode rows, in the bucket's buffer
            pad = np.zeros(bucket, dtype=np.int64)  # padding rows point at slot 0
            pad[: len(rows.dec_slots)] = rows.dec_slots
            b.extras["dec_pad"] = pad
            if not self.graphs.holds(bucket, pad):  # usually it does: the same rows as last step
                b.put("dec_pad", pad)
            self.backend.stage_graph(bucket, rows.dec_slots, dec_kv, b)
        else:
            b.put("res_slots", res)
            stage_target_batch(rows, self.t, self.backend, b, dec_kv)
        if len(res) and self.state.logprobs[res].max(initial=-1) >= 0:
            e, t = len(e_rows), self.t
            # logits rows: one per sampled extend row, t per decode row; laid out as [R, t]
            b.put("lp_idx", np.concatenate([np.arange(e) * t, e * t + np.arange(len(rows.dec_slots) * t)]))

    def _dec_slots(self, rows: PlanRows, b: StageBatch) -> torch.Tensor:
        """The decode rows' slots on the device (a graph step's: its bucket's slot buffer,
        which ``DecodeGraphs.run`` filled earlier on the stream)."""
        if "dec_pad" in b.extras:
            return self.graphs.slots(len(rows.dec_slots))
        return b["slots"][len(rows.ext_slots):]

    def _res_slots(self, rows: PlanRows, b: StageBatch) -> torch.Tensor:
        return self._dec_slots(rows, b) if "dec_pad" in b.extras else b["res_slots"]

    def _decode_tokens(self, rows: PlanRows, b: StageBatch) -> torch.Tensor | None:
        if len(rows.dec_slots) == 0:
            return None
        dec_slots_t = self._dec_slots(rows, b)
        bonus = self.state.last_token[dec_slots_t]
        if self.assistant is None:
            return bonus[:, None]
        fb = build_draft_batch(dec_slots_t, rows.dec_slots, self.state, self.backend, self.windows, DRAFT_ROPE_OFFSET)
        tokens = torch.empty((bonus.shape[0], self.t), dtype=bonus.dtype, device=bonus.device)
        tokens[:, 0] = bonus
        draft_chain(self.assistant, self.backend, fb, tokens, self.state.hidden[dec_slots_t], self.t - 1)
        return tokens

    def _row_sampling(self, slots: np.ndarray, slots_t: torch.Tensor) -> RowSampling:
        st = self.state
        return RowSampling(st, slots_t, not bool(st.greedy[slots].all()), bool(st.filtered[slots].any()))

    def _sample(self, rows: PlanRows, logits, b: StageBatch, dec_tokens):
        """-> out [R, T] tokens, accept [R], and per row the logits row of its seed hidden."""
        t, e_rows = self.t, rows.sampled_ext_rows()
        e = len(e_rows)
        parts_out, parts_acc, seeds = [], [], []
        if e:
            ext_slots, ext_slots_t, pos = rows.ext_slots[e_rows], b["samp_ext_slots"], b["samp_ext_pos"]
            lg = logits[:e]
            if self.proc.active(ext_slots):
                lg = self.proc.apply(lg, ext_slots, ext_slots_t, pos)
            lg = self._constrain(lg, logits[:e], ext_slots)
            tok = sample(lg, self._row_sampling(ext_slots, ext_slots_t), pos)
            parts_out.append(torch.cat([tok[:, None], tok.new_zeros(e, t - 1)], dim=1))
            parts_acc.append(torch.ones(e, dtype=torch.int64, device=self.device))
            seeds.append(torch.arange(e, device=self.device))
        if len(rows.dec_slots):
            dec_slots_t = self._dec_slots(rows, b)
            rs = self._row_sampling(rows.dec_slots, dec_slots_t)
            seq = self.state.seq_len[dec_slots_t]
            lg = logits[e:]
            if self.proc.active(rows.dec_slots):
                pos = (seq[:, None] + 1 + torch.arange(t, device=self.device)[None, :]).reshape(-1)
                drafts = dec_tokens[:, 1:] if self.assistant is not None else None
                lg = self.proc.apply(lg, rows.dec_slots, dec_slots_t, pos, drafts)
            lg = self._constrain(lg, logits[e:], rows.dec_slots,
                                 dec_tokens[:, 1:] if self.assistant is not None else None)
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
        if len(parts_out) == 1:
            return parts_out[0], parts_acc[0], seeds[0]
        return torch.cat(parts_out), torch.cat(parts_acc), torch.cat(seeds)

    def _update_state(self, rows: PlanRows, b: StageBatch, out, accept, seed_hidden) -> None:
        st = self.state
        n_ext = len(rows.ext_slots)
        if n_ext:
            st.seq_len[b["slots"][:n_ext]] = b["ext_kv"]
        res_slots = self._res_slots(rows, b)
        if len(res_slots) == 0:
            return
        e = len(rows.sampled_ext_rows())
        st.seq_len[res_slots[e:]] += accept[e:]
        final = out.gather(1, (accept - 1)[:, None]).squeeze(1)
        st.last_token[res_slots] = final
        st.hidden[res_slots] = seed_hidden.to(st.hidden.dtype)

    def _logprobs(self, rows: PlanRows, b: StageBatch, logits, out):
        if "lp_idx" not in b:
            return None
        slots = rows.result_slots()
        full = logits.new_zeros(len(slots) * self.t, logits.shape[-1])
        full[b["lp_idx"]] = logits
        return token_logprobs(full, out.reshape(-1), int(self.state.logprobs[slots].max()))

    def _copy_home(self, xs: list, timer) -> tuple[list, object]:
        """Host copies of the step's outputs ``xs`` (None stays None) that later steps never
        rewrite, and the event after which they have landed (None on the CPU); marks the
        timer's end first.

        On CUDA the copies run on a side stream (``copies``), so the next step's kernels need
        not queue behind a device-to-host copy (~5-10 us of copy and gaps a step on the H200).
        Invariants: a source is read there only after every kernel queued before it on the
        compute stream; a temporary is not reused before its copy (``record_stream``); a graph
        bucket's ``result`` buffer is rewritten only after the last copy (``launch`` waits for
        ``_copied`` before a tail replay). On the CPU a clone: ``x`` may be a graph bucket's
        buffer, which the next step overwrites before this one is read."""
        timer.mark()
        if self.device.type != "cuda":
            return [None if x is None else x.clone() for x in xs], None
        self.copies.wait_stream(torch.cuda.current_stream(self.device))
        hosts = []
        with torch.cuda.stream(self.copies):
            for x in xs:
                host = None  # (a logprobs part that was not asked for)
                if x is not None:
                    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                    host.copy_(x, non_blocking=True)
                    x.record_stream(self.copies)
                hosts.append(host)
            self._copied = torch.cuda.Event()
            self._copied.record(self.copies)
        return hosts, self._copied

    def _copy_out(self, step_id, rows, out, accept, lps, prompt_lps, timer) -> Pending:
        hosts, event = self._copy_home([out.to(torch.int32), accept.to(torch.int32), *(lps or ())], timer)
        lp = tuple(hosts[2:]) if lps is not None else None
        return self._pending(step_id, rows, hosts[0], hosts[1], lp, prompt_lps, event, timer)

    def _pending(self, step_id, rows, tokens, accept, lp, prompt_lps, event, timer) -> Pending:
        res = rows.result_slots()
        observe = self.grammar.observe if self.grammar.active(res) else None
        return Pending(step_id, res, tokens, accept, lp, prompt_lps, event, timer, self.grammar.take_errors(), observe)

    def _constrain(self, lg, raw, slots: np.ndarray, drafts=None):
        """``lg`` with the grammar masks of the constrained rows among ``slots``. Before the
        step's first mask the steps in flight return (the ``retire`` given to ``launch``)."""
        if not self.grammar.active(slots):
            return lg
        if self._retire is not None:
            retire, self._retire = self._retire, None
            retire()
        return self.grammar.apply(lg, raw, slots, drafts, min_tokens=bool(self.proc.has_min[slots].any()))

    def _copy_out_result(self, step_id, rows, result: torch.Tensor, timer) -> Pending:
        """The greedy tail's [n, T + 1] int32 (tokens, accept) home in one copy."""
        (host,), event = self._copy_home([result], timer)
        return self._pending(step_id, rows, host[:, : self.t], host[:, self.t], None, [], event, timer)
