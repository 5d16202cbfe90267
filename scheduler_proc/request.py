"""The scheduler's view of one request.

Lengths (all in tokens), with T = tokens per step (1 plain, S+1 with MTP):

    prompt        fixed; on preemption the tokens generated so far are folded into the
                  re-prefill (``fill_tokens``), never re-emitted
    prefilled     fill tokens already planned as extend chunks
    worst_len     KV length after every planned step, assuming each in-flight decode step
                  accepts all T tokens; becomes exact as results arrive
    pages         page ids backing [0, len(pages) * page_size)

Invariant: ``len(pages) * page_size >= worst_len`` after every plan; a decode step needs
``worst_len + T`` covered before it is planned. The scheduler lags the worker by up to
depth − 1 steps (``--overlap-depth``), so the worker's own seq_len is the truth and ``worst_len`` only bounds it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from proto.messages import SamplingParams


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DRAINING = "draining"  # finished or preempted; waits for in-flight steps before release
    DONE = "done"


@dataclass(eq=False)
class Req:
    rid: str
    prompt: np.ndarray  # int32
    params: SamplingParams
    arrival: float
    max_new_tokens: int  # params.max_new_tokens capped by the context length
    received: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.WAITING
    slot: int = 0
    seed: int = 0
    pages: list[int] = field(default_factory=list)
    page_hashes: list[int] = field(default_factory=list)  # hashes of fill_tokens' full pages
    registered_pages: int = 0  # prefix of ``pages`` already published in the prefix cache
    output_ids: list[int] = field(default_factory=list)
    fill_tokens: np.ndarray | None = None  # what the (re-)prefill computes
    prefilled: int = 0
    prefill_returned: int = 0  # fill tokens whose extend step has returned (KV surely written)
    cached_tokens: int = 0
    worst_len: int = 0
    inflight: int = 0  # planned steps whose result has not come back
    decode_inflight: int = 0
    finish_reason: str | None = None
    requeue: bool = False  # preempted: back to the waiting queue once drained
    verify_ct: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    stop_ids: frozenset[int] = frozenset()  # token ids that finish it (EOS unless ignore_eos), set at add

    @property
    def fill(self) -> np.ndarray:
        return self.prompt if self.fill_tokens is None else self.fill_tokens

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= len(self.fill)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def surely_done(self) -> bool:
        """Every in-flight decode step yields at least one token: planning more is waste.
        The sampled last prefill chunk, while in flight, yields one too (without counting it,
        max_new_tokens=1 under overlap always got a decode row whose tokens were dropped)."""
        planned = len(self.output_ids) + self.decode_inflight
        if planned + 1 < self.max_new_tokens:  # (most calls) not done, whatever ``sampling`` is
            return False
        sampling = self.prefill_done and self.prefill_returned < len(self.fill)
        return planned + sampling >= self.max_new_tokens
