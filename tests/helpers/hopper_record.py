"""The record half of the sm_90 compile check (``hopper_compile.py``): while the engine runs
under Triton's interpreter, making its launch choices as on the H200 (``cuda_launch_choices``:
PDL levels, prefetch depths, split-KV by SM count), note every kernel launch as its module, name,
argument kinds (a tensor's dtype and 16-byte alignment; a scalar by what the JIT specialises it
on) and keyword constexprs and launch options: one record per variant. A launch the GPU spreads
over its SMs (a KV split, one head a program) is recorded as the GPU makes it and run as the CPU
makes it (same outputs, fewer interpreted programs), and launches whose outputs nothing reads
are only recorded."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
from typing import Any, Iterator

import torch



def _encode(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return {"tensor": str(v.dtype).removeprefix("torch."), "aligned16": v.data_ptr() % 16 == 0}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    value = getattr(v, "value", None)  # a tl.constexpr wrapper
    if value is not None and value is not v:
        return _encode(value)
    raise TypeError(f"cannot record a kernel argument of type {type(v).__name__}")


def _runtime_value(v: Any) -> Any:
    """A non-constexpr scalar as Triton's JIT tells it apart: an int by width and by being 1 or a
    multiple of 16 (``tt.divisibility``), any float alike. So launches differing only in a
    length or a scale record once."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return v
    if isinstance(v, float):
        return 0.5
    if v == 1:
        return 1
    wide = not -2**31 <= v < 2**31
    return (2**40 if wide else 0) + (16 if v % 16 == 0 else 17)


def launch_record(fn, args: tuple, kwargs: dict) -> str:
    """One launch as a canonical JSON string (the set of these is the variants to compile)."""
    params = list(inspect.signature(fn).parameters.values())
    args = [a if "constexpr" in str(p.annotation) else _runtime_value(a) for p, a in zip(params, args)]
    return json.dumps({"module": fn.__module__, "name": fn.__name__,
                       "args": [_encode(a) for a in args],
                       "kwargs": {k: _encode(v) for k, v in sorted(kwargs.items())}}, sort_keys=True)


class _Mode:
    """What an interpreted launch does while recording: ``note`` only records it (the GPU's launch
    choice, whose outputs the same call recomputes more cheaply), ``quiet`` only runs it (that
    cheaper recomputation, which the GPU would not launch)."""
    note = False
    quiet = False


@contextlib.contextmanager
def recording() -> Iterator[set[str]]:
    """Record every interpreted kernel launch (they still run, unless noted only) into the
    yielded set."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: set[str] = set()
    real = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not _Mode.quiet:
            seen.add(launch_record(self.fn, args, kwargs))
        if _Mode.note:
            return None
        return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield seen
    finally:
        InterpretedFunction.run = real


@contextlib.contextmanager
def _mode(note: bool = False, quiet: bool = False) -> Iterator[None]:
    before = _Mode.note, _Mode.quiet
    _Mode.note, _Mode.quiet = note, quiet
    try:
        yield
    finally:
        _Mode.note, _Mode.quiet = before


def _noted_then_run(fn, cpu: dict, gpu_choices=contextlib.nullcontext):
    """``fn`` called twice: its launches as the GPU makes them (its arguments, under
    ``gpu_choices``) recorded and not run, then as the CPU makes them (keyword overrides ``cpu``)
    run and not recorded -- the same outputs from fewer interpreted programs (the GPU's choices
    spread a small batch over its SMs, one program a head or a KV split, which the interpreter
    runs one after another)."""
    def call(*args, **kwargs):
        with _mode(note=True), gpu_choices():
            fn(*args, **kwargs)
        with _mode(quiet=True):
            return fn(*args, **{**kwargs, **cpu})
    return call


H200_SMS = 132


@contextlib.contextmanager
def cuda_launch_choices(sms: int) -> Iterator[None]:
    """While recording, let the host make its launch choices as on a GPU with ``sms`` SMs: each
    kernel module's ``pdl`` applies the device-free rule (``kernels.pdl_level``: PDL levels and
    the GEMV's L2 prefetch depth come out as on the H200; the interpreter's ``gdc`` helpers stay
    no-ops), the attention backend splits the KV for ``sms`` and RoPE takes one head a program
    (the GPU's rule at the test sizes). Those last two launches are recorded as the GPU makes
    them and run as the CPU does (``_noted_then_run``): one split and heads grouped."""
    import pkgutil

    import gpu_worker.kernels as kernels
    from gpu_worker.attention import triton_backend
    from gpu_worker.kernels import rope
    from gpu_worker.models import layers

    def cuda_pdl(x) -> int:
        return kernels.pdl_level(x.shape[0])

    names = [f"gpu_worker.kernels.{m.name}" for m in pkgutil.iter_modules(kernels.__path__)]
    patched = [(m, attr) for m in map(importlib.import_module, names)
               for attr, v in vars(m).items() if v is kernels.pdl]
    assert patched, "no kernel module imports kernels.pdl: the recorder's patch point moved"
    assert triton_backend.paged_decode is attention_decode_fn() and layers.rope_store is rope.rope_store, \
        "the recorder's patch points moved"
    sms_before, heads_before = triton_backend.CPU_SMS, rope.heads_per_program

    @contextlib.contextmanager
    def gpu_heads():
        rope.heads_per_program = lambda t, h, cpu=False: heads_before(t, h)
        try:
            yield
        finally:
            rope.heads_per_program = heads_before

    for m, attr in patched:
        setattr(m, attr, cuda_pdl)
    triton_backend.CPU_SMS = sms
    triton_backend.paged_decode = _noted_then_run(attention_decode_fn(), {"num_splits": 1, "order": None})
    layers.rope_store = _noted_then_run(rope.rope_store, {}, gpu_choices=gpu_heads)
    try:
        yield
    finally:
        for m, attr in patched:
            setattr(m, attr, kernels.pdl)
        triton_backend.CPU_SMS = sms_before
        triton_backend.paged_decode, layers.rope_store = attention_decode_fn(), rope.rope_store


def attention_decode_fn():
    from gpu_worker.kernels.attention_decode import paged_decode

    return paged_decode


# (model, draft, dtype, CUDA-graph emulation, SMs, merge kernel, engine flags): the engine paths
# whose kernels the GPU runs -- fp32 and bf16 (the GEMV and the fused QKV+RoPE take only half
# dtypes), eager and graph decode, chunked prefill, Gemma 4's windows and softcaps,
# frozen-KV MTP with sampling and penalties; split-KV decode with its merge fused and separate (no
# tickets left: the merge kernel) (132 SMs: the tiny models' few rows x heads split 16 ways) and
# unsplit, longest row first (2 SMs: what a Hopper card launches for large batches); MoE targets
# (routing, the experts' decode and grouped paths, the Gemma 4 MoE norms), with frozen-KV MTP on
# Gemma 4's; FP8 weights and the FP8 KV cache (the fused QKV+RoPE storing e4m3 on bf16 weights;
# the FP8 GEMV, GEMM and activation quantization online, MTP's draft reading FP8 KV).
# Each run records variants no other run does (compared record for record); bf16 Gemma 4 with
# its assistant records none beyond the MoE pair's and the FP8 pair's, so it is not run.
# ``record_fp8_kernels`` adds every FP8 weight layout and activation scheme the engine runs do
# not reach; ``record_moe_configs`` every MoE launch shape in moe_configs.json.
FP8 = {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}
ENGINE_RUNS = (
    ("llama", None, "float32", False, 2, False, {}),
    ("llama", None, "bfloat16", True, H200_SMS, True, {}),
    ("qwen3", None, "bfloat16", True, 2, False, {}),
    ("gemma4", "assistant", "float32", False, 2, False, {}),
    ("qwen3_moe", None, "bfloat16", True, H200_SMS, False, {}),
    ("gemma4_moe", "assistant_moe", "bfloat16", True, H200_SMS, False, {}),
    ("llama", None, "bfloat16", True, H200_SMS, False, {"kv_cache_dtype": "fp8_e4m3"}),
    ("gemma4", "assistant", "bfloat16", True, H200_SMS, False, FP8),
)
# Prompts longer than the Gemma 4 test window (8) and the page, of unequal lengths (3 rows take
# bucket 4, with a padding row); a lone request first, so the one-row kernels run too.
PROMPTS = [[(7 * j + 3 * i) % 370 + 6 for j in range(10 + 5 * i)] for i in range(3)]


def _run_engine(eng) -> None:
    eng.submit("solo", PROMPTS[0], max_new_tokens=2, ignore_eos=True)
    eng.run()
    for i, p in enumerate(PROMPTS):
        sampled = {"temperature": 0.8, "seed": 1, "repetition_penalty": 1.1} if i == 1 else {}
        eng.submit(f"r{i}", p, max_new_tokens=4, ignore_eos=True, **sampled)
    eng.run()


def record_engine(root) -> set[str]:
    """Run ``ENGINE_RUNS`` on tiny checkpoints under ``root`` with the triton backend (the caller
    set ``TRITON_INTERPRET=1``; ``main`` lets tiny weights take the GEMV) and return every launch
    recorded."""
    import os
    import pathlib
    from unittest import mock

    from gpu_worker.kernels import attention_decode
    from tests.helpers.checkpoints import build_kernel_set
    from tests.helpers.hopper_moe import record_moe_configs
    from tests.helpers.inproc import InProcEngine

    ck = build_kernel_set(pathlib.Path(root))
    with recording() as seen:
        for model, draft, dtype, graphs, sms, merge_kernel, flags in ENGINE_RUNS:
            tickets = 0 if merge_kernel else attention_decode.TICKETS
            with mock.patch.dict(os.environ, TANDEM_EMULATE_CUDA_GRAPHS="1" if graphs else "0"), \
                    mock.patch.object(attention_decode, "TICKETS", tickets), cuda_launch_choices(sms):
                _run_engine(InProcEngine(ck[model], draft=ck[draft] if draft else None, attention_backend="triton",
                                         dtype=dtype, page_size=4, chunked_prefill_size=16, cuda_graph_bs=(1, 2, 4),
                                         **flags))
        with cuda_launch_choices(H200_SMS), _mode(note=True):  # launches whose outputs nothing reads
            record_fp8_kernels()
            record_moe_configs()
    return seen


def record_fp8_kernels() -> None:
    """Launch the FP8 GEMVs (split-K; the tensor-core one's big and long-K tiles and gated epilogue
    too), the GEMM, activation quantization and one-row qkv + RoPE in every weight layout (row
    scales; 128-column blocks, per row and per 128-row group) and activation scheme (weight-only,
    dynamic, static), at one and several rows: the variants other checkpoint formats compile."""
    from gpu_worker.kernels import enable_cpu_kernels
    from gpu_worker.kernels.fp8_gemv import DOT_BIG, DOT_LONG_K, fp8_gemv_dot
    from gpu_worker.kernels.fp8_linear import A8, fp8_linear
    from gpu_worker.kernels.qkv_rope import qkv_rope_store
    from gpu_worker.quant.fp8_math import FP8

    # 512 columns: K split in two at one row; float32 rows: a float32 model (the GPU tests), exact dots
    xs = [torch.randn(m, 512).to(torch.bfloat16) for m in (1, 3, 20)] + [torch.randn(m, 512) for m in (1, 3, 20)]
    inp = torch.tensor([0.05])
    for rows, kb in ((1, 1), (1, 4), (128, 4)):
        w = torch.randn(256, 512).to(FP8)
        s = torch.rand(-(-256 // rows), kb) + 0.5
        for acts in ("none", "dynamic", "static"):
            for x in xs:
                fp8_linear(x, w, s, rows, acts, inp)
            if acts == "dynamic" and rows == 1:  # the other tiles; gate_up + SiLU at 3 rows (split K)
                for cfg in (DOT_BIG, DOT_LONG_K):
                    fp8_gemv_dot(xs[0], w, s, rows, 1, cfg=cfg)
                fp8_gemv_dot(xs[1], w, s, rows, 1, act="silu")
            kv = torch.zeros(4, 2, 32, dtype=FP8)  # 4 query + 2 x 2 KV heads of 32 = the weight's 256 rows
            enable_cpu_kernels(True)
            try:
                qkv_rope_store(xs[0], w, torch.tensor([3]), torch.ones(16), torch.tensor([1]), kv, kv.clone(), 4, 2, 32,
                               scale=s, scale_rows=rows, a8=A8[acts], input_scale=inp)
            finally:
                enable_cpu_kernels(False)
