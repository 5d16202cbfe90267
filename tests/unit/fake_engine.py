"""A fake engine (scheduler side of the sockets) for testing tokenizer_proc end to end over ZMQ.

It binds the ``requests`` PULL, connects to ``outputs``, announces EngineInfo, and answers each
GenerateReq with deterministic tokens: by default the prompt's own tokens, cycled; or whatever
``output_fn(req)`` returns. Knobs a test may change at any time (they are read by the thread):

- ``tokens_per_step``: tokens per ReqOutput (speculative decoding), reported as spec stats;
- ``step_s``: time between steps; ``paused``: stop stepping (requests stay running);
- ``error_token``: a prompt containing this id is rejected with error_code 400;
- ``grammar_error``: a request with a grammar (``params.grammar``) is rejected with this text and
  error_code 400 before any token, as the worker answers a grammar that does not compile;
- ``eos_after``: emit EOS as the N-th token (finish "stop", matched_stop = EOS);
- ``extra_eos``: more ids that end a request like EOS (a generation_config's second EOS);
- ``max_running``: only the oldest N requests step; the rest are reported as waiting.

Finish rules match the real scheduler's: the earliest of EOS / stop_token_ids (after
min_new_tokens) and max_new_tokens, applied token by token inside a multi-token step. Aborts
answer with a finishing ReqOutput(finish_reason="abort"), as the scheduler does. Every message
received is kept in ``received`` for assertions.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq

from proto.arrays import pack_f32, pack_i32, view_i32
from proto.messages import (
    AbortReq,
    EngineDead,
    EngineInfo,
    GenerateReq,
    Logprobs,
    ReqOutput,
    ReqTimings,
    SchedulerStats,
    Shutdown,
    StepOutputs,
)
from proto.transport import Endpoints, PullChannel, PushChannel


@dataclass
class FakeReq:
    msg: GenerateReq
    tokens: list[int]  # the full planned output
    emitted: int = 0
    verify_ct: int = 0
    started: float = field(default_factory=time.monotonic)


def fake_logprob(pos: int) -> float:
    return -0.25 * (pos % 4 + 1)


class FakeEngine:
    def __init__(self, endpoints: Endpoints, vocab_size: int, eos_id: int, max_context: int = 512):
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.max_context = max_context
        self.ctx = zmq.Context()
        self.requests = PullChannel(self.ctx, "requests", endpoints.requests)
        self.outputs = PushChannel(self.ctx, "outputs", endpoints.outputs)
        self.received: list = []
        self.running: dict[str, FakeReq] = {}
        self.tokens_per_step = 1
        self.step_s = 0.002
        self.paused = False
        self.error_token: int | None = None
        self.grammar_error: str | None = None
        self.eos_after: int | None = None
        self.extra_eos: tuple[int, ...] = ()
        self.max_running = 32
        self.generate_count = 0  # GenerateReqs read (SchedulerStats.requests_received)
        self.output_fn: Callable[[GenerateReq], list[int]] | None = None
        self.drafts = self.accepted = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)

    # ------------------------------------------------------------------ control
    def start(self, send_info: bool = True) -> FakeEngine:
        if send_info:
            self.send_info()
        self.thread.start()
        return self

    def send_info(self) -> None:
        with self._lock:  # the loop thread sends on the same socket; zmq sockets are not thread-safe
            self._send_info()

    def _send_info(self) -> None:
        self.outputs.send(EngineInfo(
            max_context=self.max_context, vocab_size=self.vocab_size, page_size=16, num_pages=64,
            max_running_requests=self.max_running, device="cpu", dtype="float32", architecture="FakeForCausalLM",
            speculative_num_steps=3, eos_token_ids=(self.eos_id,),
        ))

    def send_dead(self, reason: str) -> None:
        with self._lock:
            self.outputs.send(EngineDead(reason))

    def stop(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(5)
        self.requests.close()
        self.outputs.close()
        self.ctx.term()

    def of_type(self, cls) -> list:
        return [m for m in list(self.received) if isinstance(m, cls)]

    def wait_for(self, pred: Callable[[], bool], timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return True
            time.sleep(0.005)
        return pred()

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        last_stats = 0.0
        while not self._stop.is_set():
            msg = self.requests.recv(timeout_ms=int(self.step_s * 1000) or 1)
            while msg is not None:
                self.received.append(msg)
                self._handle(msg)
                msg = self.requests.recv(timeout_ms=0)
            with self._lock:
                if not self.paused and self.running:
                    self._step()
                now = time.monotonic()
                if now - last_stats > 0.05:
                    self.outputs.send(self._stats())
                    last_stats = now

    def _handle(self, msg) -> None:
        with self._lock:
            if isinstance(msg, GenerateReq):
                self.generate_count += 1
                self._admit(msg)
            elif isinstance(msg, AbortReq):
                req = self.running.pop(msg.rid, None)
                if req is not None:
                    n_prompt = len(req.msg.prompt_ids) // 4
                    self._send([ReqOutput(msg.rid, b"", finish_reason="abort", prompt_tokens=n_prompt)])
            elif isinstance(msg, Shutdown):
                self._stop.set()

    def _admit(self, msg: GenerateReq) -> None:
        prompt = view_i32(msg.prompt_ids).tolist()
        if (self.error_token is not None and self.error_token in prompt) or len(prompt) >= self.max_context:
            self._send([ReqOutput(msg.rid, b"", finish_reason="error", error="fake engine rejects this prompt",
                                  error_code=400, prompt_tokens=len(prompt))])
            return
        if self.grammar_error is not None and msg.params.grammar is not None:
            self._send([ReqOutput(msg.rid, b"", finish_reason="error", error=self.grammar_error, error_code=400,
                                  prompt_tokens=len(prompt))])
            return
        tokens = self.output_fn(msg) if self.output_fn else list(itertools.islice(itertools.cycle(prompt), 4096))
        if self.eos_after is not None:
            tokens = tokens[: self.eos_after - 1] + [self.eos_id] + tokens[self.eos_after - 1 :]
        self.running[msg.rid] = FakeReq(msg, tokens)
        if msg.params.prompt_logprobs >= 0:
            lp = self._logprobs(prompt[1:], 0, msg.params.prompt_logprobs)
            self._send([ReqOutput(msg.rid, b"", prompt_logprobs=lp)])

    def _logprobs(self, tokens: list[int], start: int, k: int) -> Logprobs:
        chosen = [fake_logprob(start + i) for i in range(len(tokens))]
        top_ids = [(t + j) % self.vocab_size for t in tokens for j in range(k)]
        top_lps = [c - 0.5 * j for c in chosen for j in range(k)]
        return Logprobs(pack_f32(chosen), pack_i32(top_ids), pack_f32(top_lps), k)

    def _cut(self, req: FakeReq, new: list[int]) -> tuple[list[int], str | None, int | None]:
        p = req.msg.params
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else {self.eos_id, *self.extra_eos})
        for i, tok in enumerate(new):
            produced = req.emitted + i + 1
            if tok in stop_ids and produced > p.min_new_tokens:
                return new[: i + 1], "stop", tok
            if produced >= p.max_new_tokens:
                return new[: i + 1], "length", None
        if req.emitted + len(new) >= len(req.tokens):
            return new, "length", None
        return new, None, None

    def _step(self) -> None:
        outs = []
        for rid, req in list(self.running.items())[: self.max_running]:
            new = req.tokens[req.emitted : req.emitted + self.tokens_per_step]
            kept, reason, matched = self._cut(req, new)
            start = req.emitted
            req.emitted += len(kept)
            if self.tokens_per_step > 1:
                req.verify_ct += 1
                self.drafts += 1
                self.accepted += len(new) - 1
            k = req.msg.params.logprobs
            lp = self._logprobs(kept, start, k) if k >= 0 else None
            extra = {}
            if reason is not None:
                del self.running[rid]
                extra = {"timings": ReqTimings(0.001, 0.002, time.monotonic() - req.started)}
            outs.append(ReqOutput(rid, pack_i32(kept), finish_reason=reason, matched_stop=matched,
                                  prompt_tokens=len(req.msg.prompt_ids) // 4, cached_tokens=1,
                                  spec_verify_ct=req.verify_ct, logprobs=lp, **extra))
        self._send(outs)

    def _send(self, outs: list[ReqOutput]) -> None:
        if outs:
            self.outputs.send(StepOutputs(outs))

    def _stats(self) -> SchedulerStats:
        steps = self.tokens_per_step - 1
        return SchedulerStats(
            num_running=min(len(self.running), self.max_running),
            num_waiting=max(0, len(self.running) - self.max_running), kv_pages_used=len(self.running),
            kv_pages_total=64, requests_received=self.generate_count,
            num_slots_held=min(len(self.running), self.max_running),
            prefix_queries=100, prefix_hits=40, spec_num_drafts=self.drafts,
            spec_num_draft_tokens=self.drafts * max(steps, 0),
            spec_num_accepted_tokens=self.accepted, spec_accepted_per_pos=tuple([self.drafts] * max(steps, 0)),
        )
