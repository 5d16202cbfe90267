"""Every message that crosses a process boundary, as msgspec Structs.

Four PUSH/PULL channels (docs/design.md §2), each with a tagged union and a typed decoder:

    requests : tokenizer_proc -> scheduler_proc   GenerateReq | AbortReq | FlushCache | Shutdown
    outputs  : scheduler_proc -> tokenizer_proc   StepOutputs | SchedulerStats | EngineInfo | EngineDead
    plans    : scheduler_proc -> gpu_worker       StepPlan | Shutdown
    results  : gpu_worker -> scheduler_proc       WorkerReady | StepResult | WorkerError

Token ids, page ids and per-token floats travel as little-endian ``bytes`` (int32 / float32);
use ``proto.arrays`` to pack and view them. Decode steps carry slot ids, never sequences.
"""

from __future__ import annotations

from typing import Union

import msgspec

PROTOCOL_VERSION = 1


GRAMMAR_KINDS = ("json", "regex", "ebnf", "choice", "structural_tag")


class GrammarSpec(msgspec.Struct, frozen=True, array_like=True):
    """A constraint on the generated text, compiled by the worker (xgrammar).

    ``kind`` is one of GRAMMAR_KINDS; ``text`` is a JSON Schema (``json``; OpenAI's
    ``json_object`` is ``{"type": "object"}``), a regular expression (``regex``), a GBNF/EBNF
    grammar with a ``root`` rule (``ebnf``), a JSON array of the allowed strings (``choice``), or an
    xgrammar structural tag (``structural_tag``: ``{"type": "structural_tag", "format": {...}}``, or
    the older ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``).
    ``any_whitespace=False`` (vLLM's ``disable_any_whitespace``) gives JSON fixed separators.
    ``after`` >= 0: the grammar binds only after the first time the request emits that token
    (the reasoning end, ``</think>``, under ``--reasoning-parser``: the model reasons freely, then
    answers in the grammar, as vLLM and SGLang do); -1: from the first token.
    """

    kind: str
    text: str
    any_whitespace: bool = True  # json: any whitespace between tokens (False: fixed separators)
    after: int = -1  # token id that starts the grammar (-1: none, it binds from the first token)


class GrammarCompile(msgspec.Struct, frozen=True, array_like=True):
    """A waiting request's grammar, for the worker to compile before the scheduler admits it
    (``key``: the scheduler's handle on the request; the answer is a ``GrammarDone``)."""

    key: int
    spec: GrammarSpec


class GrammarDone(msgspec.Struct, frozen=True, array_like=True):
    """A ``GrammarCompile`` finished: ``error`` "" (compiled: the request may be admitted) or the
    message its request ends with (HTTP 400)."""

    key: int
    error: str = ""


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """Per-request sampling and stopping rules the engine itself applies.

    Stop *strings* are not here: the tokenizer process matches them on text (docs/design.md §3).
    """

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0 disables
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int = -1  # -1: none; k >= 0: chosen-token logprob plus top-k alternatives
    prompt_logprobs: int = -1  # -1: none; k >= 0: logprobs of prompt tokens (echo)
    # OpenAI's logit_bias: added to the logits of these token ids before penalties and sampling
    # (greedy included); logprobs stay the raw model's
    logit_bias_ids: tuple[int, ...] = ()
    logit_bias: tuple[float, ...] = ()
    # Structured output: only tokens that keep the text inside this grammar are sampled; once
    # the grammar is complete only end ids may follow (docs/architecture.md, "Structured output")
    grammar: GrammarSpec | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


# ---------------------------------------------------------------- requests channel


class GenerateReq(msgspec.Struct, tag="generate", frozen=True):
    rid: str
    prompt_ids: bytes  # int32
    params: SamplingParams
    arrival: float  # time.time() at the HTTP front


class AbortReq(msgspec.Struct, tag="abort", frozen=True):
    rid: str
    reason: str = "client_disconnect"  # client_disconnect | stop_string | shutdown


class FlushCache(msgspec.Struct, tag="flush_cache", frozen=True):
    pass


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    reason: str = ""


RequestMsg = Union[GenerateReq, AbortReq, FlushCache, Shutdown]


# ---------------------------------------------------------------- outputs channel


class Logprobs(msgspec.Struct, frozen=True):
    """Logprobs for ``n`` consecutive tokens; ``top`` alternatives each (top may be 0)."""

    token_logprobs: bytes  # float32 [n]
    top_ids: bytes = b""  # int32 [n, top]
    top_logprobs: bytes = b""  # float32 [n, top]
    top: int = 0


class ReqTimings(msgspec.Struct, frozen=True):
    """Scheduler-side intervals in seconds, measured on the scheduler's own clock."""

    queue_s: float = 0.0  # received -> first scheduled
    prefill_s: float = 0.0  # first scheduled -> first token
    decode_s: float = 0.0  # first token -> last token


class ReqOutput(msgspec.Struct, frozen=True, omit_defaults=True):
    """New tokens of one request from one step. Tokens past a finish are never included."""

    rid: str
    token_ids: bytes  # int32, possibly empty
    finish_reason: str | None = None  # stop | length | abort | error
    matched_stop: int | None = None  # the EOS / stop token id that finished the request
    error: str | None = None  # set with finish_reason == "error"
    error_code: int = 0  # HTTP status the front should use for an error before any token
    prompt_tokens: int = 0
    cached_tokens: int = 0
    spec_verify_ct: int = 0  # verify steps so far
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None  # for prompt tokens 1..P-1 (token 0 has none)
    timings: ReqTimings | None = None  # on the finishing output only


class StepOutputs(msgspec.Struct, tag="outputs", frozen=True):
    outputs: list[ReqOutput]


class SchedulerStats(msgspec.Struct, tag="stats", frozen=True):
    """Gauges and cumulative counters; the front turns counter deltas into increments."""

    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    prefix_queries: int = 0  # tokens looked up in the prefix cache (cumulative)
    prefix_hits: int = 0  # tokens found (cumulative)
    num_preemptions: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0  # accepted drafts, bonus excluded (vLLM semantics)
    spec_accepted_per_pos: tuple[int, ...] = ()
    steps: int = 0
    requests_received: int = 0  # GenerateReqs the scheduler has read (cumulative; front admission)
    # Requests holding a running slot, finished ones whose last step is still in flight included
    # (num_running leaves those out). Front admission: slots full means the queue is slot-bound,
    # so a held slot frees within a step; slots free with a queue means KV pages hold it back.
    num_slots_held: int = 0
    step_time_s: float = 0.0  # scheduler wall time spent planning + processing (cumulative)
    worker_forward_s: float = 0.0  # worker time in target forward (cumulative)
    worker_draft_s: float = 0.0  # worker time in the draft loop (cumulative)
    worker_busy_s: float = 0.0  # device-busy time of every step (cumulative; CUDA events on GPU)
    worker_gap_s: float = 0.0  # device idle between consecutive steps while work was queued (cumulative)
    decode_steps: int = 0  # steps without a prefill chunk (cumulative), and of those:
    decode_busy_s: float = 0.0  # device-busy time
    decode_tokens: int = 0  # tokens emitted
    decode_ctx_tokens: int = 0  # context tokens attended over, summed over rows


class EngineInfo(msgspec.Struct, tag="engine_info", frozen=True):
    """Sent once when the engine is up, for /server_info and request validation."""

    max_context: int
    vocab_size: int
    page_size: int
    num_pages: int
    max_running_requests: int
    device: str
    dtype: str
    architecture: str
    speculative_num_steps: int = 0
    eos_token_ids: tuple[int, ...] = ()
    kv_cache_dtype: str = ""  # the KV pool's storage dtype ("float8_e4m3fn" with --kv-cache-dtype fp8_e4m3)
    quantization: str = ""  # the target's weight format in words ("" unquantized)


class EngineDead(msgspec.Struct, tag="engine_dead", frozen=True):
    reason: str


OutputMsg = Union[StepOutputs, SchedulerStats, EngineInfo, EngineDead]


# ---------------------------------------------------------------- plans channel


class AdmitRow(msgspec.Struct, frozen=True, array_like=True):
    """A new request takes ``slot``; its sampling state lives on the worker from now on."""

    slot: int
    params: SamplingParams
    seed: int  # 63-bit; the request's own RNG stream (docs/design.md §3)
    prompt_len: int = 0  # positions >= prompt_len hold generated tokens (penalties, min_tokens)


class PageAppend(msgspec.Struct, frozen=True, array_like=True):
    """Pages appended to ``slot``'s page table starting at column ``first_col``."""

    slot: int
    first_col: int
    pages: bytes  # int32


class ExtendRow(msgspec.Struct, frozen=True, array_like=True):
    """A prefill chunk: tokens at positions [start, start + len). ``sample`` on the last chunk."""

    slot: int
    start: int
    token_ids: bytes  # int32
    sample: bool


class StepPlan(msgspec.Struct, tag="plan", frozen=True):
    """One forward step. Row order of the result: sampled extend rows, then decode rows.

    Invariants: a slot appears in at most one of ``extend``/``decode``; ``free`` names slots
    whose last referencing step has already returned a result (docs/design.md §4.3).
    """

    step_id: int
    admit: list[AdmitRow] = []
    pages: list[PageAppend] = []
    extend: list[ExtendRow] = []
    decode_slots: bytes = b""  # int32
    free: list[int] = []
    compile: list[GrammarCompile] = []  # waiting requests' grammars (a plan may carry only these)


PlanMsg = Union[StepPlan, Shutdown]


# ---------------------------------------------------------------- results channel


class WorkerReady(msgspec.Struct, tag="ready", frozen=True):
    page_size: int
    num_pages: int  # usable pages (page 0 is reserved as padding)
    max_slots: int  # usable slots 1..max_slots (slot 0 is the padding row)
    vocab_size: int
    max_context: int
    dtype: str
    device: str
    architecture: str
    tokens_per_step: int  # 1 plain, S+1 with MTP
    speculative_num_steps: int = 0
    eos_token_ids: tuple[int, ...] = ()
    kv_bytes_per_token: int = 0
    kv_cache_dtype: str = ""
    quantization: str = ""
    # False where decode steps run compiled programs that a step with prefill rows forgoes (the
    # CPU's): the scheduler then plans prefill and decode steps apart.
    mixed_prefill: bool = True


class PromptLogprobRows(msgspec.Struct, frozen=True, array_like=True):
    slot: int
    start: int  # position of the first token these logprobs describe
    logprobs: Logprobs


class SlotError(msgspec.Struct, frozen=True, array_like=True):
    """A request the worker cannot serve (a grammar that does not compile): the scheduler ends
    the request in ``slot`` with an HTTP 400 error; tokens its rows carry are dropped."""

    slot: int
    message: str


class StepResult(msgspec.Struct, tag="result", frozen=True):
    """Outputs of one step, rows in plan order (sampled extend rows, then decode rows).

    ``tokens`` is [rows, tokens_per_step]; row r's new tokens are the first accept_lens[r].
    """

    step_id: int
    slots: bytes  # int32 [rows]
    tokens: bytes  # int32 [rows, tokens_per_step]
    accept_lens: bytes  # int32 [rows]
    logprobs: Logprobs | None = None  # per token of ``tokens`` (n = rows * tokens_per_step)
    prompt_logprobs: list[PromptLogprobRows] = []
    forward_s: float = 0.0
    draft_s: float = 0.0
    busy_s: float = 0.0  # device time from the step's first to its last queued work
    gap_s: float = 0.0  # device idle between the previous step's end and this step's start
    errors: list[SlotError] = []
    compiled: list[GrammarDone] = []  # ``StepPlan.compile`` items finished since the last result


class WorkerError(msgspec.Struct, tag="worker_error", frozen=True):
    message: str
    fatal: bool = True


ResultMsg = Union[WorkerReady, StepResult, WorkerError]
