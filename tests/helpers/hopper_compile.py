"""Compile the engine's Triton kernels for the H200 (sm_90) on a machine without a GPU.

CI has no GPU, and Triton's interpreter accepts code its compiler rejects (a type the backend
cannot lower, a constexpr misused, a block that overflows shared memory), and it never reaches
the compiled-only branches (PDL's ``griddepcontrol``, RoPE's ``mul.rn``, libdevice ``tanh``).
So the kernels a change touches could first fail on the GPU machine, whose time is scarce.
This closes that gap in two halves:

``recording()``: while the engine runs under the interpreter, making its launch choices as on
the H200 (``cuda_launch_choices``: PDL levels, prefetch depths, split-KV by SM count), note
every kernel launch as its module, name, argument kinds (a tensor's dtype and 16-byte
alignment; a scalar by what the JIT specialises it on) and keyword constexprs and launch
options: one record per variant. A launch the GPU spreads over its SMs (a KV split, one head a
program) is recorded as the GPU makes it and run as the CPU makes it (same outputs, fewer
interpreted programs), and launches whose outputs nothing reads are only recorded.

``compile_launches()``: in a process *without* the interpreter (so the modules define their
compiled-mode kernels), point Triton at a stand-in CUDA driver that names an sm_90 target and
``warmup`` each recorded launch: Triton's own binder specialises it as on the GPU (alignment,
``do_not_specialize``) and its compiler goes all the way to a cubin through ``ptxas``, with
nothing launched. The constexprs the host sets by device take their CUDA values, and a record
with a pointer the CPU had unaligned is built aligned too (CUDA staging aligns). A launch's
``PDL`` level follows its token count (on at <= 4), so each record is built at the level it was
recorded at, and one record of each kernel at every level besides: each kernel's PDL-on and
PDL-off code is built without doubling every variant. Shared memory is checked against sm_90's
per-block limit -- meaningful at real widths (``record-shapes``), less so at the tiny test models'.

Run as ``python -m tests.helpers.hopper_compile record|compile ...`` with any Triton on the path
(``make hopper-check`` does both, with CI's Triton and the GPU machine's).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import sys
from typing import Any, Iterator

import torch

TARGET = ("cuda", 90, 32)  # H100/H200: backend, compute capability 9.0, warp size
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB, opt-in maximum)
PDL_LEVELS = (0, 2)  # kernels/__init__.py: PDL_OFF, PDL_ON


def _encode(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return {"tensor": str(v.dtype).removeprefix("torch."), "aligned16": v.data_ptr() % 16 == 0}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    value = getattr(v, "value", None)  # a tl.constexpr wrapper
    if value is not None and value is not v:
        return _encode(value)
    raise TypeError(f"cannot record a kernel argument of type {type(v).__name__}")


def _decode(v: Any) -> Any:
    if isinstance(v, dict):
        dtype = getattr(torch, v["tensor"])
        base = torch.empty(64, dtype=dtype)  # torch's CPU allocations are 64-byte aligned
        return base[:32] if v["aligned16"] else base[1:33]
    return v


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


def _noted_then_run(fn, gpu: dict, cpu: dict, patch_gpu=contextlib.nullcontext, patch_cpu=contextlib.nullcontext):
    """``fn`` called twice: its launches as the GPU makes them (keyword overrides ``gpu``, under
    ``patch_gpu``) recorded and not run, then as the CPU makes them (``cpu``, ``patch_cpu``) run
    and not recorded -- the same outputs from fewer interpreted programs (the GPU's choices spread
    a small batch over its SMs, one program a head or a KV split, which the interpreter runs one
    after another)."""
    def call(*args, **kwargs):
        with _mode(note=True), patch_gpu():
            fn(*args, **{**kwargs, **gpu})
        with _mode(quiet=True), patch_cpu():
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
    triton_backend.paged_decode = _noted_then_run(attention_decode_fn(), {}, {"num_splits": 1, "order": None})
    layers.rope_store = _noted_then_run(rope.rope_store, {}, {}, patch_gpu=gpu_heads)
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


class _Sm90Driver:
    """What ``JITFunction.run(warmup=True)`` asks of the active driver, for an H200 that is not
    there: the device, the stream and the compile target. Nothing is loaded or launched."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(*TARGET)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


def _variants(kwargs: dict, first_dtype: str | None, every_pdl: bool) -> list[dict]:
    """The launch as the GPU would make it: the constexprs the host sets by device at their CUDA
    values (the GEMVs' and the FP8 GEMM's ``F32`` and attention's ``IEEE``: exact dots for float32
    operands only, always under the interpreter; softcap.py ``LIBDEVICE``: tanh); with
    ``every_pdl``, a kernel with a ``PDL`` constexpr also at the levels its recorded one is not."""
    cuda = {"F32": first_dtype == "float32", "LIBDEVICE": True, "IEEE": first_dtype == "float32"}
    kw = {**kwargs, **{k: v for k, v in cuda.items() if k in kwargs}}
    if "PDL" not in kw or not every_pdl:
        return [kw]
    out = [kw]
    for level in PDL_LEVELS:
        if level != kw["PDL"]:
            out.append({**kw, "PDL": level, "launch_pdl": level == 2, **({"PREFETCH_K": 0} if level != 2 and
                                                                          "PREFETCH_K" in kw else {})})
    return out


def _aligned(args: list) -> list:
    """The record with every tensor 16-byte aligned: CUDA staging pads each array to 16 bytes,
    the CPU's does not, so a pointer the CPU recorded unaligned is aligned on the GPU."""
    return [{**a, "aligned16": True} if isinstance(a, dict) else a for a in args]


def _compile_one(job: tuple[str, bool]) -> list[dict]:
    rec, every_pdl = job
    r = json.loads(rec)
    fn = getattr(importlib.import_module(r["module"]), r["name"])
    first = next((a["tensor"] for a in r["args"] if isinstance(a, dict)), None)
    arg_sets = [r["args"]] + ([_aligned(r["args"])] if _aligned(r["args"]) != r["args"] else [])
    rows = []
    for raw_args in arg_sets:
        args = [_decode(a) for a in raw_args]
        aligned = all(a["aligned16"] for a in raw_args if isinstance(a, dict))
        for kw in _variants({k: _decode(v) for k, v in r["kwargs"].items()}, first, every_pdl):
            row = {"kernel": f"{r['module']}.{r['name']}", "pdl": kw.get("PDL"), "aligned": aligned, "shared": None,
                   "error": None}
            try:
                k = fn.warmup(*args, grid=(1,), **kw)
                row["shared"] = int(k.metadata.shared)
                if row["shared"] > SMEM_LIMIT:
                    row["error"] = f"needs {row['shared']} B of shared memory; sm_90 allows {SMEM_LIMIT}"
            except Exception as e:  # noqa: BLE001 -- reported per variant, the caller asserts
                row["error"] = f"{type(e).__name__}: {str(e)[-1500:]}"
            rows.append(row)
    return rows


def _use_sm90_driver() -> None:
    from triton.runtime import driver

    driver.set_active(_Sm90Driver())


def compile_launches(records: list[str], workers: int | None = None) -> list[dict]:
    """Compile each recorded launch for sm_90 (the first of each kernel at every PDL level) in
    ``workers`` processes; one row per variant with ``error`` (None when it built) and the shared
    memory it needs, and a last row naming the Triton."""
    import concurrent.futures
    import multiprocessing
    import os

    import triton

    workers = workers or min(4, os.cpu_count() or 1)  # each imports torch and Triton
    ctx = multiprocessing.get_context("spawn")  # a clean interpreter: no driver or JIT state
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_use_sm90_driver) as pool:
        seen: set[tuple[str, str]] = set()
        jobs = []
        for rec in sorted(set(records)):
            r = json.loads(rec)
            kernel = (r["module"], r["name"])
            jobs.append((rec, kernel not in seen))
            seen.add(kernel)
        rows = [row for rows in pool.map(_compile_one, jobs) for row in rows]
    return rows + [{"triton": triton.__version__}]


def launchable_kernels() -> set[str]:
    """Every ``@triton.jit`` function of ``gpu_worker/kernels`` that host code launches, as
    ``module.name``: what the recorded runs must cover. By the kernels' naming rule, a launched
    kernel's name ends in ``_kernel``; the others are helpers called from inside kernels."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "gpu_worker" / "kernels"
    return {f"gpu_worker.kernels.{path.stem}.{name}" for path in sorted(root.glob("*.py"))
            for name in re.findall(r"@triton\.jit(?:\([^)]*\))?\s*\n\s*def (\w+_kernel)\b", path.read_text())}


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


def main(argv: list[str]) -> int:
    """``record[-shapes] OUT.json CKPT_DIR`` (under the interpreter) or ``compile IN.json OUT.json``
    (without it; exit status 1 when a variant failed)."""
    if len(argv) == 3 and argv[0] in ("record", "record-shapes"):
        import tests.conftest  # noqa: F401 -- the test session's interpreter set-up and fast path
        from gpu_worker.kernels import gemv

        gemv.SKINNY_MIN_WEIGHT = 1  # the tiny test weights take the GEMV too
        if argv[0] == "record":
            record = record_engine
        else:
            from tests.helpers.hopper_shapes import record_shapes as record
        json.dump(sorted(record(argv[2])), open(argv[1], "w"))
    elif len(argv) == 3 and argv[0] == "compile":  # a file: ptxas prints a failing PTX to stdout
        rows = compile_launches(json.load(open(argv[1])))
        json.dump(rows, open(argv[2], "w"))
        failed = [r for r in rows[:-1] if r["error"]]
        for r in failed:
            print(f"FAILED {r['kernel']} (PDL {r['pdl']}, aligned {r['aligned']}): {r['error'][:600]}",
                  file=sys.stderr)
        print(f"Triton {rows[-1]['triton']}, sm_90: {len(rows) - 1 - len(failed)} kernel variants built, "
              f"{len(failed)} failed; the most shared memory one needs: "
              f"{max((r['shared'] or 0) for r in rows[:-1]) if len(rows) > 1 else 0} B", file=sys.stderr)
        return 1 if failed else 0
    else:
        print("usage: python -m tests.helpers.hopper_compile record[-shapes] OUT.json DIR | compile IN.json OUT.json",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
