"""The GPU-worker process: load models, size the KV pool, report capacity, run steps.

Step loop (``--overlap-depth`` 3 by default, or 2): launch each plan as soon as it arrives,
while fewer than ``depth`` steps are in flight, before waiting on the oldest step's copy
event; then send that result (at depth 3 plan N+2 is usually in hand when result N goes out).
On CPU launches are synchronous, yet the scheduler still plans ahead while this process
computes.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import time
from collections import deque

import msgspec
import torch
import zmq

from gpu_worker.attention import create_backend, resolve_backend
from gpu_worker.graphs.cpu_build import BuildSpec, compiler_missing, ensure_built
from gpu_worker.graphs.cpu_ops import gemm_threads
from gpu_worker.graphs.cpu_steps import CpuDecodeSteps
from gpu_worker.graphs.decode import graph_buckets
from gpu_worker.kernels import log_compiles
from gpu_worker.kv_pool import KVPool, kv_dtype
from gpu_worker.models.cpu_layout import (amx_projections, amx_usable, bf16_exact, column_major_projections,
                                          float_projections, native_bf16)
from gpu_worker.models.eos import read_eos_token_ids
from gpu_worker.models.loader import load_model
from gpu_worker.parallel.state import rank_device, tp_size
from gpu_worker.graphs.prefill import MAX_TOKENS as PIECEWISE_MAX_TOKENS
from gpu_worker.step.runner import ModelRunner
from gpu_worker.settings import DevSettings
from gpu_worker.step.slots import SlotState
from gpu_worker.graphs.warmup import prefill_sizes, warm_prefill
from gpu_worker.sizing import plan_capacity
from common.args import ServerArgs
from proto.messages import Shutdown, StepPlan, WorkerError, WorkerReady
from proto.transport import ChannelRefused, Endpoints, PullChannel, PushChannel

log = logging.getLogger("tandem.worker")
WAIT_SLICE_MS = 1


def resolve_dtype(args: ServerArgs, device: torch.device) -> torch.dtype:
    if args.dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, args.dtype)


def draft_dtype(dtype: torch.dtype, device: torch.device, backend: str) -> torch.dtype:
    """The draft model's dtype: the target's, except for a float32 target on a CPU that
    multiplies bfloat16 in hardware (``native_bf16``) with the torch backend at TP=1 (the
    compiled CPU steps' path), whose draft runs in bfloat16. The draft only proposes: the
    target's verify decides every token, so outputs do not change, only how many drafts it
    accepts. In bfloat16 its few-row GEMMs read half the bytes through oneDNN's bf16 kernels,
    and its weights (bfloat16 in the checkpoint) take half the memory; on a CPU without
    bfloat16 instructions those kernels widen every operand in software and cost more than
    float32's (docs/decisions/cpu.md, "Draft dtype"). The Triton interpreter's bf16 dots are
    not exact, and TP shards run eagerly: both keep the target's dtype."""
    if (device.type == "cpu" and dtype == torch.float32 and backend == "torch" and tp_size() == 1
            and native_bf16()):
        return torch.bfloat16
    return dtype


def max_positions(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    return int(cfg.get("max_position_embeddings") or 4096)


def build_runner(args: ServerArgs) -> tuple[ModelRunner, WorkerReady]:
    """Load the models, size the pool and build the step runner (no sockets)."""
    settings = DevSettings.from_env()
    device = rank_device(torch.device(args.resolved_device()))  # TP: this rank's GPU
    if device.type == "cpu":  # TP ranks on one host share its cores
        torch.set_num_threads(args.num_threads or max(1, ((os.cpu_count() or 2) - 1) // tp_size()))
    elif device.index is not None:
        torch.cuda.set_device(device)
    dtype = resolve_dtype(args, device)
    name = resolve_backend(args.attention_backend, device.type)
    torch.manual_seed(args.random_seed)
    target = load_model(args.model_path, dtype, device, args.load_format, quantization=args.quantization)
    assistant = None
    if args.spec_enabled:
        try:
            assistant = load_model(args.speculative_draft_model_path, draft_dtype(dtype, device, name), device,
                                   args.load_format, target=target, quantization=args.quantization)
        except ValueError as exc:
            raise ValueError(f"--speculative-draft-model-path: {exc}") from exc
    t = args.tokens_per_step
    kv = kv_dtype(args.kv_cache_dtype, dtype)
    cap = plan_capacity(args, target, device, kv, t, max_positions(args.model_path))
    pool = KVPool(target.kv_shapes, cap.num_pages, args.page_size, kv, device, scales=target.kv_scales)
    _log_kv(pool, target)
    state = SlotState(cap.max_slots, cap.max_pages_per_slot, target.hidden_size, device, dtype)
    amx = False
    if device.type == "cpu" and name == "torch" and tp_size() == 1:  # torch's ops on the CPU (no kernels):
        amx = _amx_layout(args, settings.emulate_cuda_graphs, kv, target, assistant)
        for model in (target, assistant):  # before anything binds the weights' storage
            if model is not None:
                (amx_projections if amx else column_major_projections)(model)
    backend = create_backend(name, pool=pool, page_table=state.page_table)
    # An EOS id outside the vocabulary (a broken config) could never be sampled; dropping it
    # keeps the min_tokens mask from indexing out of range.
    eos = tuple(i for i in read_eos_token_ids(args.model_path, args.tokenizer_dir) if 0 <= i < target.vocab_size)
    runner = ModelRunner(target, assistant, backend, state, t, device, eos, args.tokenizer_dir,
                         not args.constrained_json_disable_any_whitespace, settings)
    # On the CPU, --attention-backend triton runs every kernel (norms, RoPE too) in the interpreter.
    runner.cpu_kernels = name in ("triton", "flashinfer") and device.type != "cuda"  # flashinfer: tests' fake
    if device.type == "cuda":  # the CPU has no lazy kernel loading to pay ahead (and CI starts many engines)
        sizes = prefill_sizes(args.chunked_prefill_size or 8192, state.page_table.shape[1] * args.page_size)
        log.info("prefill warm-up: %s tokens in %.2f s", sizes, warm_prefill(runner, sizes))
    _setup_graphs(args, runner, name, device, cap.max_slots, settings.emulate_cuda_graphs, amx)
    if settings.log_compiles:
        log_compiles(log)  # what start-up did not warm
    ready = WorkerReady(
        page_size=args.page_size,
        num_pages=cap.num_pages,
        max_slots=cap.max_slots,
        vocab_size=target.vocab_size,
        max_context=cap.max_context,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        architecture=type(target).__name__,
        tokens_per_step=t,
        speculative_num_steps=t - 1 if args.spec_enabled else 0,
        eos_token_ids=eos,
        kv_bytes_per_token=KVPool.bytes_per_token(target.kv_shapes, kv),
        kv_cache_dtype=str(kv).removeprefix("torch."),
        quantization=target.quant_format.describe() if target.quant_format is not None else "",
        mixed_prefill=not isinstance(runner.graphs, CpuDecodeSteps),
    )
    return runner, ready


def _log_kv(pool: KVPool, target) -> None:
    """One start-up line: the KV cache's dtype, size in tokens and, for FP8, where its scales came from."""
    tokens = (pool.num_pages - 1) * pool.page_size
    if not pool.fp8:
        log.info("KV cache: %s, %d tokens", str(pool.dtype).removeprefix("torch."), tokens)
        return
    have = sorted(i for i in target.kv_scales if i < len(pool.shapes))
    source = (f"k/v scales from the checkpoint for {len(have)} of {len(pool.shapes)} layers"
              + ("" if len(have) == len(pool.shapes) else ", 1.0 for the rest")) if have else \
        "k/v scales 1.0 (the checkpoint has none)"
    log.info("KV cache: fp8_e4m3, %d tokens (twice what the model dtype would hold); %s", tokens, source)


def _amx_layout(args: ServerArgs, emulate: bool, kv: torch.dtype, target, assistant) -> bool:
    """Whether the models' projections take the AMX layout (``models/cpu_layout.py``): where the
    compiled CPU steps are to run (their library's GEMM is the one that reads it fast), the CPU
    has AMX-BF16 and every projection weight is a bfloat16 value (docs/decisions/cpu.md, "AMX")."""
    if emulate or args.disable_cuda_graph or kv.itemsize == 1 or compiler_missing():  # (FP8 KV: eager steps)
        return False
    return amx_usable() and all(m is None or bf16_exact(m) for m in (target, assistant))


def _setup_graphs(args: ServerArgs, runner: ModelRunner, backend: str, device: torch.device, max_slots: int,
                  emulate: bool, amx: bool = False):
    """CUDA graphs for decode steps, then piecewise graphs for prefill steps of up to the step
    budget (at most ``PIECEWISE_MAX_TOKENS``): on by default on CUDA with a graph-capable backend.
    ``emulate`` (``DevSettings``) runs the same bucket/padding paths eagerly off CUDA (CPU tests).
    On the CPU decode steps run compiled programs instead (``graphs/cpu_steps.py``)."""
    if device.type == "cpu" and not emulate and not args.disable_cuda_graph:
        runner.graphs = _cpu_steps(args, runner, backend, max_slots, amx)
        if amx and runner.graphs is None:  # eager steps: the layout they read at full speed
            float_projections(runner.target, runner.state.hidden.dtype)
            if runner.assistant is not None:
                float_projections(runner.assistant, draft_dtype(runner.state.hidden.dtype, device, backend))
        return
    if args.disable_cuda_graph or (device.type != "cuda" and not emulate):
        return
    if not hasattr(runner.backend, "decode_meta"):
        log.warning("CUDA graphs off: --attention-backend %s cannot be captured (use triton or flashinfer)", backend)
        return
    runner.enable_graphs(graph_buckets(args.cuda_graph_bs, args.cuda_graph_max_bs or 256, max_slots), emulate)
    if args.disable_piecewise_cuda_graph:
        return
    if backend not in ("triton", "flashinfer") or tp_size() > 1:
        log.warning("piecewise prefill graphs off: they need --attention-backend triton or flashinfer at TP=1")
        return
    budget = min(args.chunked_prefill_size or 8192, PIECEWISE_MAX_TOKENS)
    runner.enable_prefill_graphs(budget, emulate)


def _cpu_steps(args: ServerArgs, runner: ModelRunner, backend: str, max_slots: int,
               amx: bool) -> CpuDecodeSteps | None:
    """The compiled CPU decode steps, built on the first start for this model shape and code
    (``graphs/cpu_build.py``), or None: eager steps (another backend, TP, no compiler)."""
    if backend != "torch" or tp_size() > 1 or runner.backend.pool.fp8:
        log.info("compiled CPU steps off: they need --attention-backend torch, TP=1 and --kv-cache-dtype auto")
        return None
    dtype = runner.state.hidden.dtype
    spec = BuildSpec(args.model_path, args.speculative_draft_model_path if args.spec_enabled else None,
                     _dtype_name(dtype), runner.t, args.page_size, args.load_format,
                     _dtype_name(draft_dtype(dtype, runner.device, backend)), amx)
    paths = ensure_built(spec)
    if paths is None:
        return None
    steps = CpuDecodeSteps.load(paths, runner.target, runner.assistant, runner.state, runner.backend.pool, runner.t,
                                min(args.cuda_graph_max_bs or max_slots, max_slots))
    # One intra-op thread by default leaves a core to the scheduler and the front, idle most of a
    # step: the library's kernels borrow it (never waiting on it: cpu_split.cpp).
    if args.num_threads is None and torch.get_num_threads() == 1 and (os.cpu_count() or 1) > 1:
        gemm_threads(2)
    return steps


def _return_free_heap() -> None:
    """glibc keeps the heap that start-up freed (checkpoint reads, casts, the build's temporaries)
    mapped; give it back to the OS, so the worker's resident size is what it holds."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _graphs_note(graphs) -> str:
    if graphs is None:
        return "off"
    if isinstance(graphs, CpuDecodeSteps):
        return f"compiled for the CPU, batch 1-{graphs.max_batch}"
    return f"CUDA, batch sizes {graphs.sizes}"


class HostClock:
    """Where the worker's host time goes (``DevSettings.host_timing``): per phase of the loop,
    logged every 200 steps. Off by default (one attribute check per tick)."""

    def __init__(self, on: bool):
        self.on, self.acc, self.steps, self.t = on, {}, 0, time.perf_counter()

    def tick(self, phase: str, step: bool = False) -> None:
        if not self.on:
            return
        now = time.perf_counter()
        self.acc[phase] = self.acc.get(phase, 0.0) + now - self.t
        self.t = now
        self.steps += step
        if step and self.steps % 200 == 0:
            log.warning("host ms/step over 200 steps: %s",
                        {k: round(1e3 * v / 200, 3) for k, v in self.acc.items()})
            self.acc = {}


def inflight_limit(args: ServerArgs) -> int:
    """Steps a worker (every TP rank alike) keeps launched before it retires the oldest: the
    scheduler's depth (at depth 1 it sends no plan before the last result, so 2 changes nothing)."""
    return max(2, args.step_depth)


class Worker:
    def __init__(self, args: ServerArgs, ep: Endpoints):
        self.args = args
        self.depth = inflight_limit(args)
        self.ctx = zmq.Context()
        self.plans = PullChannel(self.ctx, "plans", ep.plans)
        self.results = PushChannel(self.ctx, "results", ep.results)

    def setup(self) -> WorkerReady:
        self.runner, ready = build_runner(self.args)
        return ready

    def run(self) -> None:
        """Launch each plan as it arrives; send a result once its copy is done. On CUDA the
        next plan is launched before the previous result is waited for (up to ``depth`` steps
        in flight); on CPU a step is done when launch returns, so its result goes out at once."""
        inflight: deque = deque()
        clock = HostClock(self.runner.settings.host_timing)
        if clock.on:
            self.runner.tick = clock.tick
        while True:
            clock.tick("idle")
            plan = self._next_plan(inflight)
            clock.tick("recv")
            if isinstance(plan, Shutdown):
                break
            if plan is not None:
                inflight.append(self.runner.launch(plan, retire=lambda: self._send_all(inflight)))
                clock.tick("launch", step=True)
            # No plan: the oldest step is done (``_next_plan``), send it; a later one still
            # running is not waited for here (at depth 3 the next plan may come first).
            force = plan is None
            while inflight and (force or inflight[0].ready() or len(inflight) >= self.depth):
                force = False
                res = inflight.popleft().result()
                clock.tick("wait")
                self.results.send(res)
                clock.tick("send")
        self._send_all(inflight)

    def _send_all(self, inflight: deque) -> None:
        """Every step in flight returns, oldest first (also a constrained step's ``retire``)."""
        while inflight:
            self.results.send(inflight.popleft().result())

    def _next_plan(self, inflight: deque) -> StepPlan | Shutdown | None:
        """A plan, or None once the oldest in-flight step is done (or ``depth`` are in flight).

        With fewer than ``depth`` steps in flight the scheduler usually sends the next plan right
        after it reads the previous result, a moment *after* we sent it: wait for either that
        plan or the step, in 1 ms slices, so the device never drains while a plan is on its way
        (at depth 3 that plan is usually here already)."""
        if not inflight:
            return self._recv(block=True)
        if len(inflight) >= self.depth:
            return None
        while not inflight[0].ready():
            plan = self._recv(block=False, timeout_ms=WAIT_SLICE_MS)
            if plan is not None:
                return plan
        return self._recv(block=False)

    def _recv(self, block: bool, timeout_ms: int = 0) -> StepPlan | Shutdown | None:
        while True:
            try:
                return self.plans.recv(timeout_ms=None if block else timeout_ms)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.error("dropping malformed plan frame: %s", exc)

    def close(self) -> None:
        self.plans.close()
        self.results.close()
        self.ctx.term()


def run(args: ServerArgs, endpoints: Endpoints, status_conn=None, worker: Worker | None = None) -> None:
    """Process entry point (spawned by the supervisor); ``worker``: TP rank 0's subclass."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    worker = worker or Worker(args, endpoints)
    try:
        try:
            ready = worker.setup()
        except Exception as exc:  # report a start-up failure as one line, then exit non-zero
            if isinstance(exc, (ValueError, FileNotFoundError, RuntimeError)):
                log.error("worker start-up failed: %s", exc)  # a bad input: no traceback
            else:
                log.exception("worker start-up failed")
            worker.results.send(WorkerError(f"{type(exc).__name__}: {exc}"))
            if status_conn is not None:
                status_conn.send(("error", f"{type(exc).__name__}: {exc}"))
            raise SystemExit(1) from None
        # Everything allocated so far (models, Triton's compiler state, graphs) lives as long as
        # the process: freeze it out of the garbage collector, whose full passes over a heap that
        # large stalled steps by tens of milliseconds.
        gc.collect()
        gc.freeze()
        _return_free_heap()
        worker.results.send(ready)
        log.info("worker ready: %s on %s, %d KV pages of %d tokens, %d slots, context %d, attention %s, "
                 "decode graphs %s", ready.architecture, ready.device, ready.num_pages, ready.page_size,
                 ready.max_slots, ready.max_context, type(worker.runner.backend).__name__,
                 _graphs_note(worker.runner.graphs))
        worker.run()
    except ChannelRefused as exc:  # a tcp:// peer with other keys: one line, not a hang or a traceback
        log.error("%s", exc)
        raise SystemExit(1) from None
    finally:
        worker.close()
