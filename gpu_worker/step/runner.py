"""One step of the worker: plan in, launched device work out, result copied back async.

``launch(plan)`` enqueues everything for the step on the current stream and returns a
``Pending`` whose host buffers fill once its copy event fires; step N+1 can be launched
before step N's event (it reads N's outputs from slot state, ordered by the stream).

A step is ``prepare`` (host: the path's typed inputs, ``inputs.py``, in one upload; the slot
state they change) -> ``forward`` (device: graph replay or eager forward -> ``Forward``) ->
``sample`` (device: tokens, accept counts, slot state; the copy home -> ``Pending``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from gpu_worker.graphs.decode import DecodeBody, DecodeGraphs
from gpu_worker.graphs.prefill import PrefillGraphs
from gpu_worker.kernels import enable_cpu_kernels
from gpu_worker.settings import DevSettings
from gpu_worker.spec.mtp import DRAFT_ROPE_OFFSET, draft_chain
from gpu_worker.step.batch import PlanRows, build_draft_batch, build_target_batch
from gpu_worker.step.inputs import EagerStep, GraphStep, eager_step, graph_step, logprob_rows
from gpu_worker.step.pending import CopyHome, Pending
from gpu_worker.step.processors import LogitProcessors
from gpu_worker.step.prompt_logprobs import prompt_logprob_rows
from gpu_worker.step.sampling import token_logprobs
from gpu_worker.step.select import TokenSelector
from gpu_worker.step.slots import SlotState
from gpu_worker.step.timer import StepTimer
from gpu_worker.structured.grammar import GrammarRows
from gpu_worker.upload import PinnedRing
from proto.messages import StepPlan


@dataclass
class Forward:
    """A step's forward on the device."""

    dec_tokens: torch.Tensor | None  # [D, T] the decode rows' inputs: bonus (+ MTP drafts)
    dec_slots: torch.Tensor  # [D] the decode rows' slots
    result_slots: torch.Tensor  # [R] the result rows' slots
    hidden: torch.Tensor  # every token's target hidden state (prompt logprobs read it)
    sel_hidden: torch.Tensor  # the hidden states of the logits rows
    logits: torch.Tensor  # [R_logits, V]


def _no_tick(phase: str, step: bool = False) -> None:
    pass


class ModelRunner:
    """Launches steps. Decode-only steps whose batch fits a bucket replay CUDA graphs
    (``graphs/decode.py``); other steps (prefill chunks) replay the piecewise prefill graphs
    (``graphs/prefill.py``) up to the step budget, eagerly beyond it. Either way the step's host
    data crosses to the device in one copy (``gpu_worker/upload.py``)."""

    def __init__(self, target, assistant, backend, state: SlotState, tokens_per_step: int, device,
                 eos_ids: tuple[int, ...] = (), tokenizer_dir: str | None = None, json_any_whitespace: bool = True,
                 settings: DevSettings = DevSettings()):
        self.target, self.assistant, self.backend, self.state = target, assistant, backend, state
        self.settings = settings
        self.t = tokens_per_step
        self.device = device
        self.proc = LogitProcessors(state.seq_len.shape[0], target.vocab_size, device, eos_ids)
        self.grammar = GrammarRows(tokenizer_dir, target.vocab_size, eos_ids, device, json_any_whitespace)
        self.select = TokenSelector(state, self.proc, self.grammar, tokens_per_step, assistant is not None, device)
        self.windows = tuple(sorted(set(target.sliding_windows) | set(getattr(assistant, "sliding_windows", ()))))
        self.ring = PinnedRing(device)
        self.home = CopyHome(device)
        self.graphs: DecodeGraphs | None = None
        self.prefill: PrefillGraphs | None = None
        self._last_timer: StepTimer | None = None
        self.tick = _no_tick  # HostClock.tick under DevSettings.host_timing (worker main)
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
        piecewise graphs (``graphs/prefill.py``, captured here)."""
        enable_cpu_kernels(self.cpu_kernels)
        dtype = self.state.hidden.dtype  # the model's
        self.prefill = PrefillGraphs(self.target, self.backend, max_tokens, dtype, self.device, emulate=emulate)
        self.prefill.capture()
        return self.prefill

    def launch(self, plan: StepPlan, retire: Callable[[], None] | None = None) -> Pending:
        """``retire``: returns every step in flight (the caller's loop sends their results). A step
        that samples for a constrained row calls it after its forward is queued and before its
        masks are built: the masks need those steps' tokens, and the device runs this step's
        forward while the host waits (``structured/grammar.py``). A plan with no rows only asks
        after grammars compiling ahead of admission: no device work, a short wait for one."""
        self.grammar.precompile(plan.compile)
        has_rows = bool(plan.extend) or bool(plan.decode_slots)
        if has_rows:
            pending = self._launch(plan, retire)
        else:
            pending = Pending(plan.step_id, np.zeros(0, np.int64), torch.zeros((0, self.t), dtype=torch.int32),
                              torch.zeros(0, dtype=torch.int32), None, [], None, StepTimer(self.device, None))
        # Only a plan that just asks (nothing in flight then: the scheduler sends it so) waits a
        # little for a compile; one handing grammars over may have earlier steps to return.
        pending.compiled = self.grammar.take_compiled(0.01 if not has_rows and not plan.compile else 0.0)
        return pending

    @torch.inference_mode()
    def _launch(self, plan: StepPlan, retire: Callable[[], None] | None) -> Pending:
        self.select.retire = retire if retire is not None and self.grammar.needs_sync(plan) else None
        enable_cpu_kernels(self.cpu_kernels)  # process-wide, set per step: tests run several runners
        timer = self._last_timer = StepTimer(self.device, self._last_timer)
        inp = self.prepare(plan, timer)
        self.tick("l.prepare")
        fwd = self.forward(inp, timer)
        self.tick("l.forward")
        return self.sample(inp, fwd, timer)

    # ------------------------------------------------------------ prepare (host)
    def prepare(self, plan: StepPlan, timer: StepTimer) -> GraphStep | EagerStep:
        """The step's host half: slots freed, host mirrors updated, the path's inputs built and
        uploaded in one copy; then the slot-state rows they carry written on the device."""
        st = self.state
        st.free(plan.free)
        self.grammar.stage(plan)  # compiles admitted requests' grammars
        rows = PlanRows.from_plan(plan)
        res = rows.result_slots()
        common = dict(step_id=plan.step_id, rows=rows, admitted=st.stage_admit(plan.admit), processors=self.proc.stage_admit(plan.admit),
                      pages=st.stage_pages(plan.pages),
                      logprob_rows=logprob_rows(rows, self.t, len(res) > 0 and st.logprobs[res].max(initial=-1) >= 0))
        # the decode rows' KV lengths after this step's tokens, where the host knows them (no MTP)
        dec_kv = st.seq_host[rows.dec_slots] + self.t if self.assistant is None else None
        bucket = self.graphs.bucket(len(rows.dec_slots)) if self.graphs is not None and rows.decode_only else None
        if bucket is not None:
            inp = graph_step(common, bucket, self.graphs, self.backend, dec_kv)
        else:
            inp = eager_step(common, self.t, self.backend, dec_kv)
        st.advance_host(rows)
        upload = self.ring.upload()
        upload.add(inp)
        upload.send()  # the step's one host-to-device copy
        timer.mark()
        st.apply_admit(inp.admitted)
        self.proc.apply_admit(inp.processors)
        st.apply_pages(inp.pages)
        if isinstance(inp, GraphStep):
            self.backend.prepare_graph(bucket, inp.attn)  # plan()-style host work, outside the graph
        self.proc.observe_extend(rows)
        self.grammar.observe_extend(rows)
        return inp

    # ------------------------------------------------------------ forward (device)
    def forward(self, inp: GraphStep | EagerStep, timer: StepTimer) -> Forward:
        """Graph steps replay their bucket (the draft loop, a timer mark, the target); eager steps
        run the draft chain for their decode rows, then one target forward, then the LM head on
        the rows that sample."""
        rows = inp.rows
        if isinstance(inp, GraphStep):
            dec_tokens, hidden, logits = self.graphs.run(len(rows.dec_slots), inp.padded, inp.slots, timer.mark)
            slots = self.graphs.slots(len(rows.dec_slots))
            return Forward(dec_tokens, slots, slots, hidden, hidden, logits)
        dec_slots = inp.slots[len(rows.ext_slots):]
        dec_tokens = self._decode_tokens(rows, dec_slots)
        timer.mark()
        fb = build_target_batch(inp, self.state, self.backend, self.windows, self.t, dec_tokens)
        if self.prefill is not None and self.prefill.bucket(fb.num_tokens) is not None:
            hidden = self.prefill.forward(fb)
        else:
            hidden = self.target.forward(fb, self.backend)
        sel = hidden[inp.logit_rows]
        return Forward(dec_tokens, dec_slots, inp.result_slots, hidden, sel, self.target.compute_logits(sel))

    def _decode_tokens(self, rows: PlanRows, dec_slots: torch.Tensor) -> torch.Tensor | None:
        """The decode rows' input tokens: the bonus, and with MTP the draft chain's S drafts."""
        if len(rows.dec_slots) == 0:
            return None
        bonus = self.state.last_token[dec_slots]
        if self.assistant is None:
            return bonus[:, None]
        fb = build_draft_batch(dec_slots, rows.dec_slots, self.state, self.backend, self.windows, DRAFT_ROPE_OFFSET)
        tokens = torch.empty((bonus.shape[0], self.t), dtype=bonus.dtype, device=bonus.device)
        tokens[:, 0] = bonus
        draft_chain(self.assistant, self.backend, fb, tokens, self.state.hidden[dec_slots], self.t - 1)
        return tokens

    # ------------------------------------------------------------ sample (device), copy home
    def sample(self, inp: GraphStep | EagerStep, fwd: Forward, timer: StepTimer) -> Pending:
        """Tokens and accept counts for the result rows, the slot state they commit, their
        logprobs, and the copy home. An all-greedy graph step does all of that in its tail graph."""
        rows = inp.rows
        if isinstance(inp, GraphStep) and self._greedy_tail(inp):
            self.home.before_rewrite()  # the tail rewrites the buffer the last copy reads
            result = self.graphs.run_tail(len(rows.dec_slots))
            self.tick("l.sample")
            timer.mark()
            (host,), event = self.home.copy([result], timer)
            return self._pending(inp, host[:, : self.t], host[:, self.t], None, [], event, timer)
        sampled = inp.sampled if isinstance(inp, EagerStep) else None
        out, accept, seed_rows = self.select.tokens(rows, fwd.logits, fwd.dec_slots, fwd.dec_tokens, sampled)
        self.tick("l.sample")
        prompt_lps = prompt_logprob_rows(self.target, rows, self.state, fwd.hidden)
        timer.mark()
        self._commit(inp, fwd, out, accept, seed_rows)
        self.proc.observe_outputs(rows.result_slots(), fwd.result_slots, out, accept)
        lps = self._logprobs(inp, fwd.logits, out)
        hosts, event = self.home.copy([out.to(torch.int32), accept.to(torch.int32), *(lps or ())], timer)
        return self._pending(inp, hosts[0], hosts[1], tuple(hosts[2:]) if lps is not None else None, prompt_lps,
                             event, timer)

    def _greedy_tail(self, inp: GraphStep) -> bool:
        """All rows greedy, no logit processors, grammar or logprobs: the tail graph selects the
        tokens and updates slot state (``DecodeGraphs.run_tail``)."""
        slots = inp.rows.dec_slots
        return (inp.logprob_rows is None and bool(self.state.greedy[slots].all())
                and not self.proc.active(slots) and not self.grammar.active(slots))

    def _commit(self, inp, fwd: Forward, out, accept, seed_rows) -> None:
        """Slot state after the step: prefilled rows' lengths; the result rows' accepted length,
        last token and MTP seed hidden."""
        st, rows = self.state, inp.rows
        n_ext = len(rows.ext_slots)
        if n_ext:
            st.seq_len[inp.slots[:n_ext]] = inp.ext.kv_len
        if len(fwd.result_slots) == 0:
            return
        e = len(rows.sampled_ext_rows())
        st.seq_len[fwd.result_slots[e:]] += accept[e:]
        st.last_token[fwd.result_slots] = out.gather(1, (accept - 1)[:, None]).squeeze(1)
        st.hidden[fwd.result_slots] = fwd.sel_hidden[seed_rows].to(st.hidden.dtype)

    def _logprobs(self, inp, logits, out):
        if inp.logprob_rows is None:
            return None
        slots = inp.rows.result_slots()
        full = logits.new_zeros(len(slots) * self.t, logits.shape[-1])
        full[inp.logprob_rows] = logits
        return token_logprobs(full, out.reshape(-1), int(self.state.logprobs[slots].max()))

    def _pending(self, inp, tokens, accept, lp, prompt_lps, event, timer) -> Pending:
        res = inp.rows.result_slots()
        observe = self.grammar.observe if self.grammar.active(res) else None
        return Pending(inp.step_id, res, tokens, accept, lp, prompt_lps, event, timer,
                       self.grammar.take_errors(), observe)
