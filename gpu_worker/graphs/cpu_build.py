"""Build and cache the compiled CPU decode programs (``cpu_programs.py``).

A build exports each program with ``torch.export`` and compiles it with AOTInductor into a
``.pt2`` package: about a minute a program on a 2-core machine, so it happens once per model
shape and code version and is cached. Later starts only load the packages (milliseconds).

- The build runs in its own processes (``python -m gpu_worker.graphs.cpu_build``): Inductor and
  its compiler state (~150 MB) never enter the worker, which loads packages through
  ``torch._C._aoti`` alone. The worker waits for them at start-up and logs the wait. Each
  process compiles on one core; where the machine has more than one and the checkpoints are
  small (``PARALLEL_MAX_BYTES``: every process loads the models), the programs are split over
  up to one process a core (``build_groups``), which about halves a first start on two cores.
- Cache: ``<TORCHINDUCTOR_CACHE_DIR, else Inductor's default /tmp/torchinductor_<user>>/
  tandem-cpu-steps/<key>/<program>.pt2``. The key hashes what a program's code depends on:
  both models' ``config.json``, both models' dtypes, tokens per step, page size, torch's version and CPU
  capability, and the source of the code a program traces (``TRACED``: a change there rebuilds).
  Weights are not in it: packages bind the models' tensors at load.
- Concurrent starts (data-parallel engines, parallel tests) take a file lock per key: one
  builds, the others wait and load. Packages are renamed into place when complete.
- A build that raises (a model the programs cannot trace) records why in the key's directory;
  later starts of that key run eagerly at once, with the reason in their warning.
"""

from __future__ import annotations

import dataclasses
import fcntl
import getpass
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

log = logging.getLogger("tandem.worker")
FORMAT = 1  # bump when the programs' input layout changes
FAILED = "failed"  # in a key's directory: why its build raised
PARALLEL_MAX_BYTES = 1 << 30  # checkpoints above this (both models) build in one process: each loads them
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # gpu_worker/
# What a traced program runs: the models and their layers, the kernels' torch paths, the
# decode body and its CPU attention (paths under gpu_worker/).
TRACED = ("models", "kernels", "parallel", "spec", "graphs/decode.py", "graphs/cpu_attention.py",
          "graphs/cpu_programs.py", "graphs/cpu_ops.py", "graphs/cpu_gemm.cpp", "graphs/cpu_amx.cpp",
          "graphs/cpu_split.cpp", "graphs/cpu_attn.cpp", "forward_batch.py", "kv_pool.py")


@dataclass(frozen=True)
class BuildSpec:
    """What a build needs (and what its key hashes, with the code and torch's version)."""

    model_path: str
    draft_path: str | None
    dtype: str  # torch dtype name, e.g. "float32"
    tokens_per_step: int
    page_size: int
    load_format: str = "auto"
    draft_dtype: str = "float32"  # the draft model's (gpu_worker/main.py: draft_dtype)
    amx: bool = False  # the projections' AMX layout (models/cpu_layout.py), else column-major

    def programs(self) -> tuple[str, ...]:
        return ("draft", "target", "tail") if self.draft_path else ("target", "tail")


def cache_root() -> str:
    """Inductor's own cache directory (``TORCHINDUCTOR_CACHE_DIR``, else its default), so one
    setting places every compiled artefact."""
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not base:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = str(os.getuid())
        base = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    return os.path.join(base, "tandem-cpu-steps")


def _traced_files() -> list[str]:
    out = []
    for entry in TRACED:
        path = os.path.join(_PACKAGE, entry)
        if os.path.isfile(path):
            out.append(path)
        for root, dirs, files in os.walk(path):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            out += [os.path.join(root, f) for f in files if f.endswith(".py")]
    return sorted(out)


def _sources_digest() -> str:
    h = hashlib.sha256()
    for path in _traced_files():
        h.update(os.path.relpath(path, _PACKAGE).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _config_text(model_dir: str | None) -> str:
    if model_dir is None:
        return ""
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.dumps(json.load(f), sort_keys=True)


def cache_key(spec: BuildSpec) -> str:
    import torch

    parts = {
        "format": FORMAT, "torch": torch.__version__, "python": sys.version_info[:2],
        "cpu": torch.backends.cpu.get_cpu_capability(), "sources": _sources_digest(),
        "target": _config_text(spec.model_path), "draft": _config_text(spec.draft_path),
        "dtype": spec.dtype, "draft_dtype": spec.draft_dtype, "amx": spec.amx, "t": spec.tokens_per_step,
        "page_size": spec.page_size,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def compiler_missing() -> str | None:
    """Why nothing can be compiled here, or None (Inductor needs a C++ compiler)."""
    names = [os.environ.get("CXX"), "g++", "clang++", "c++"]
    if not any(n and shutil.which(n) for n in names):
        return "no C++ compiler (g++ or clang++) on PATH"
    return None


def ensure_built(spec: BuildSpec) -> dict[str, str] | None:
    """Program name -> package path, building them first if the cache lacks them; None (with
    a warning) when they cannot be built here."""
    why = compiler_missing()
    if why is not None:
        log.warning("compiled CPU steps off: %s; decode steps run eagerly", why)
        return None
    key_dir = os.path.join(cache_root(), cache_key(spec))
    paths = {name: os.path.join(key_dir, f"{name}.pt2") for name in spec.programs()}
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    if _failed(key_dir):
        return None
    try:
        os.makedirs(key_dir, exist_ok=True)
        lock = open(os.path.join(key_dir, "lock"), "w")
    except OSError as exc:
        log.warning("compiled CPU steps off: cache %s is not writable (%s); set TORCHINDUCTOR_CACHE_DIR",
                    key_dir, exc)
        return None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building this key: wait for it
        if not all(os.path.exists(p) for p in paths.values()) and not _failed(key_dir):
            _run_build(spec, key_dir)
    if not all(os.path.exists(p) for p in paths.values()):
        if not _failed(key_dir):
            log.warning("compiled CPU steps off: the build did not finish (its log is above); decode steps run eagerly")
        return None
    return paths


def _failed(key_dir: str) -> bool:
    """Whether a build of this key raised (a model the programs cannot trace, say): that is
    deterministic for the key, so later starts skip it, with the recorded reason."""
    path = os.path.join(key_dir, FAILED)
    if not os.path.exists(path):
        return False
    with open(path) as f:
        reason = f.read().strip()
    log.warning("compiled CPU steps off: their build failed: %s (remove %s to retry); decode steps run eagerly",
                reason, path)
    return True


def build_groups(programs: tuple[str, ...], cores: int, small: bool) -> list[tuple[str, ...]]:
    """The programs each build process compiles: all in one where there is one core or the
    models are large, else up to one process a core; on two cores the target (the longest
    build) alone and the draft with the tail (``docs/decisions/cpu.md``)."""
    if cores < 2 or not small or len(programs) < 2:
        return [programs]
    if cores >= len(programs):
        return [(name,) for name in programs]
    return [("target",), tuple(p for p in programs if p != "target")]


def _checkpoint_bytes(spec: BuildSpec) -> int | None:
    """The weight files' size of both models, or None where there are none to measure (dummy
    weights, a layout without safetensors or .bin files)."""
    if spec.load_format == "dummy":
        return None
    total = 0
    for d in filter(None, (spec.model_path, spec.draft_path)):
        files = [f for f in os.listdir(d) if f.endswith((".safetensors", ".bin"))] if os.path.isdir(d) else []
        if not files:
            return None
        total += sum(os.path.getsize(os.path.join(d, f)) for f in files)
    return total


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _run_build(spec: BuildSpec, key_dir: str) -> None:
    size = _checkpoint_bytes(spec)
    groups = build_groups(spec.programs(), _cores(), size is not None and size <= PARALLEL_MAX_BYTES)
    log.warning("compiling the CPU decode steps (%s) for %s in %d process%s: once per model shape and code "
                "version, cached in %s", "/".join(spec.programs()), spec.model_path, len(groups),
                "es" if len(groups) > 1 else "", key_dir)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "gpu_worker.graphs.cpu_build", json.dumps(dataclasses.asdict(spec)), key_dir]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(_PACKAGE),
                                                                     os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([*cmd, ",".join(group)], env=env) for group in groups]
    rcs = [p.wait() for p in procs]
    bad = next((rc for rc in rcs if rc != 0), 0)
    log.warning("CPU decode steps: build %s in %.0f s", "done" if not bad else f"failed (exit {bad})",
                time.perf_counter() - t0)


def build(spec: BuildSpec, key_dir: str, programs: tuple[str, ...] | None = None) -> None:
    """Export and compile ``programs`` (default: every program of ``spec``) into ``key_dir`` (in
    a build process)."""
    import torch
    import torch._inductor.config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    from gpu_worker.graphs import cpu_ops
    from gpu_worker.graphs.cpu_attention import CpuDecodeAttention
    from gpu_worker.graphs.cpu_programs import StepProgram, dynamic_shapes, example_inputs
    from gpu_worker.graphs.decode import DecodeBody
    from gpu_worker.kv_pool import KVPool
    from gpu_worker.models.cpu_layout import amx_projections, column_major_projections
    from gpu_worker.models.loader import load_model
    from gpu_worker.step.slots import SlotState

    torch.set_num_threads(1)
    inductor_config.compile_threads = 1  # no compile worker pool: the machine may have two cores
    # torch's export warns about its own internal use of a deprecated pytree class; nothing a
    # user of the build can act on, so it stays out of the worker's log.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    cpu, dtype = torch.device("cpu"), getattr(torch, spec.dtype)
    target = load_model(spec.model_path, dtype, cpu, spec.load_format)
    assistant = (load_model(spec.draft_path, getattr(torch, spec.draft_dtype), cpu, spec.load_format, target=target)
                 if spec.draft_path else None)
    for model in (target, assistant):  # the worker's weight layout: a program assumes its constants' strides
        if model is not None:
            (amx_projections if spec.amx else column_major_projections)(model)
    pool = KVPool(target.kv_shapes, 6, spec.page_size, dtype, cpu)
    state = SlotState(3, 5, target.hidden_size, cpu, dtype)  # 4 slot rows, 5 pages: distinct sizes
    # The library's attention kernel where the library will be built (a vector ISA Inductor knows)
    cpu_ops.define()
    attention = CpuDecodeAttention(pool, state.page_table, fused=bool(pick_vec_isa()))
    body = DecodeBody(target, assistant, attention, state, spec.tokens_per_step)
    rows = None
    for name in programs or spec.programs():
        t0 = time.perf_counter()
        inputs = example_inputs(name, body, attention)
        with torch.no_grad():
            program = torch.export.export(StepProgram(name, body, attention), tuple(inputs), strict=False,
                                          dynamic_shapes=dynamic_shapes(name, 2 * len(pool.k), spec.tokens_per_step))
        if rows is None:  # after an export: a concurrent build process may be compiling the library meanwhile
            rows = cpu_ops.build_library(key_dir) or ""  # the few-row GEMM (cpu_gemm.cpp), linked by name:
            os.environ["LIBRARY_PATH"] = os.pathsep.join(filter(None, [rows, os.environ.get("LIBRARY_PATH")]))
        # No precompiled headers: each build process would compile its own for one or two
        # sources, which costs more than it saves (docs/decisions/cpu.md).
        configs = {"aot_inductor.package_constants_in_so": False, "aot_inductor.precompile_headers": False,
                   "cpp_cache_precompile_headers": False}
        if rows and cpu_ops.use_rows_linear(program):
            configs.update(cpu_ops.inductor_configs())
        tmp = os.path.join(key_dir, f".{name}.{os.getpid()}.pt2")
        torch._inductor.aoti_compile_and_package(program, package_path=tmp, inductor_configs=configs)
        os.replace(tmp, os.path.join(key_dir, f"{name}.pt2"))
        log.warning("CPU decode steps: %s compiled in %.0f s", name, time.perf_counter() - t0)


def _die_with_parent() -> None:
    """Linux: SIGKILL this build if the worker that started it dies (no orphan keeps compiling)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def build_or_record(spec: BuildSpec, key_dir: str, programs: tuple[str, ...] | None = None) -> None:
    """``build``; one that raises records why (``FAILED``) and exits 1."""
    try:
        build(spec, key_dir, programs)
    except Exception as exc:  # noqa: BLE001 - recorded, and reported by the worker in one line
        log.exception("CPU decode steps: build failed")
        with open(os.path.join(key_dir, FAILED), "w") as f:
            f.write(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300])
        raise SystemExit(1) from None


if __name__ == "__main__":
    _die_with_parent()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    build_or_record(BuildSpec(**json.loads(sys.argv[1])), sys.argv[2],
                    tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else None)
