"""The compiled CPU steps' own GEMM, ``tandem_cpu::rows_linear`` (``cpu_gemm.cpp``, ``cpu_amx.cpp``,
``cpu_split.cpp``), and decode attention, ``tandem_cpu::paged_attention`` (``cpu_attn.cpp``: the
pool read in place; ``graphs/cpu_attention.py`` calls it and holds its reference).

``rows_linear(x, w)`` is ``F.linear(x, w)`` for ``x`` [M, K] and ``w`` [N, K] laid out by
``models/cpu_layout.py``:

- column-major, of x's dtype, float32 or bfloat16: up to 8 float32 rows (the target) or 4
  bfloat16 ones (the draft) its kernel (``cpu_gemm.cpp``) streams the weights as a one-row GEMV
  does, where MKL's few-row kernel reads them in K strided streams that the prefetchers do not
  follow and torch's bf16 GEMV runs AVX2 dot products (``docs/decisions/cpu.md``, "The programs'
  own GEMM"), its column blocks shared with a helper thread as below; past that it is
  ``at::mm`` (MKL, oneDNN);
- bfloat16, row-major, under a float32 or bfloat16 x (where the CPU has AMX): AMX tiles at any
  row count (``cpu_amx.cpp``; a float32 x as three bfloat16 terms: float32-accurate products),
  its column blocks shared with a helper thread where the worker lends it an idle core
  (``gemm_threads``, ``cpu_split.cpp``).
  Here x's and w's dtypes may differ, so model code calls the op itself (``linear``): an
  ``aten.linear`` cannot take them.

- Build side (``cpu_build.py``, its own process): ``build_library`` compiles the sources
  into the key's directory, ``use_rows_linear`` rewrites an exported program's float32 and
  bfloat16 linears over column-major (or bfloat16 row-major) weights into the op, and ``inductor_configs`` has
  AOTInductor call the op's C shim directly (no dispatcher, no proxy executor) and link the
  library by name.
- Worker side (``cpu_steps.py``): ``load_library`` before the packages, so that their code finds
  the library (matched by its soname: nothing searches the file system at load); eager calls of
  the op (prefill) then run the library's GEMM too, through its C shim.

The library's name carries a digest of its sources, torch's version and the vector ISA, and it
lives beside the builds' key directories: builds of several model shapes compile it once, and
programs of two builds in one process bind the same library.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import subprocess
import sys

import torch

SHIM = "AOTITorchError aoti_torch_cpu_rows_linear(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0)"
ATTENTION_SHIM = ("AOTITorchError aoti_torch_cpu_paged_attention(AtenTensorHandle q, AtenTensorHandle k, "
                  "AtenTensorHandle v, AtenTensorHandle loc, AtenTensorHandle ok, double scaling, "
                  "AtenTensorHandle* ret0)")
SOURCES = tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), f)
                for f in ("cpu_gemm.cpp", "cpu_amx.cpp", "cpu_split.cpp", "cpu_attn.cpp"))
_lib: list[torch.library.Library] = []  # the op's registration, once per process
_loaded: list[ctypes.CDLL] = []  # the library, once loaded in this process (eager calls use it)
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer  # torch._C._aoti passes handles as capsules
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_capsule = ctypes.pythonapi.PyCapsule_New
_capsule.restype, _capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


LINK = "gemm_library"  # in a key's directory: the path of the library its programs link


def library_name() -> str:
    """``tandem_cpu_<digest>``: a digest of what the library's code depends on (its source, torch's
    version and headers, the vector ISA Inductor picks here). Build side only (imports Inductor)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    h = hashlib.sha256()
    for source in SOURCES:
        with open(source, "rb") as f:
            h.update(f.read())
    h.update(f"{torch.__version__} {pick_vec_isa()}".encode())
    return f"tandem_cpu_{h.hexdigest()[:16]}"


def library_path(cache_root: str, name: str) -> str:
    """Beside the builds' key directories (``cache_root``) and shared by them: builds of several
    model shapes compile it once."""
    return os.path.join(cache_root, name, f"lib{name}.so")


def load_library(key_dir: str) -> ctypes.CDLL | None:
    """The library the key's programs link, loaded (None where the build made none: the programs
    then use MKL alone). Reads the path the build recorded: no Inductor import in the worker."""
    link = os.path.join(key_dir, LINK)
    if not os.path.exists(link):
        return None
    with open(link) as f:
        path = f.read().strip()
    if not os.path.exists(path):
        return None
    lib = ctypes.CDLL(path)
    lib.aoti_torch_cpu_rows_linear.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.aoti_torch_cpu_paged_attention.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_double,
                                                                          ctypes.POINTER(ctypes.c_void_p)]
    _loaded[:] = [lib]
    return lib


def gemm_threads(n: int) -> None:
    """The library's own kernels (AMX, the few-row GEMMs, attention) in this process on ``n``
    threads (1 or 2: the caller's and a helper that takes blocks while its core is idle,
    ``cpu_split.cpp``); needs ``load_library`` first."""
    if _loaded:
        _loaded[0].tandem_cpu_gemm_threads(n)


def define() -> None:
    """The ops' schemas, shape functions and eager bodies (for tracing and eager checks)."""
    if _lib:
        return
    lib = torch.library.Library("tandem_cpu", "DEF")
    lib.define("rows_linear(Tensor x, Tensor w) -> Tensor")
    lib.impl("rows_linear", _eager, "CPU")
    torch.library.register_fake("tandem_cpu::rows_linear", lambda x, w: x.new_empty((x.shape[0], w.shape[0])),
                                lib=lib)
    lib.define("paged_attention(Tensor q, Tensor k, Tensor v, Tensor loc, Tensor ok, float scaling) -> Tensor")
    lib.impl("paged_attention", _attention_eager, "CPU")
    torch.library.register_fake("tandem_cpu::paged_attention",
                                lambda q, k, v, loc, ok, scaling: q.new_empty((q.shape[0], q.shape[1], v.shape[2])),
                                lib=lib)
    _lib.append(lib)


def _attention_eager(q, k, v, loc, ok, scaling: float) -> torch.Tensor:
    """``paged_attention`` outside a program: the library's kernel where this process loaded it,
    else the same attention as tensor ops (``cpu_attention.attend``)."""
    if not _loaded:
        from gpu_worker.graphs.cpu_attention import attend

        return attend(q, k[loc], v[loc], ok, scaling)
    return _shim_call(_loaded[0].aoti_torch_cpu_paged_attention, [q, k, v, loc, ok], ctypes.c_double(scaling))


def _eager(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The op outside a program: the library's GEMM where this process loaded it, else
    ``torch.mm`` (the weight converted to x's dtype)."""
    if not _loaded:
        return torch.mm(x, w.t().to(x.dtype))
    return _shim_call(_loaded[0].aoti_torch_cpu_rows_linear, [x, w])


def _shim_call(fn, tensors: list[torch.Tensor], *scalars) -> torch.Tensor:
    """One of the library's C shims called from Python, as a program calls it."""
    handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(tensors)  # capsules of new at::Tensor handles
    out = ctypes.c_void_p()
    err = fn(*(_capsule_pointer(h, None) for h in handles), *scalars, ctypes.byref(out))
    torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(handles)  # frees the handles
    if err:
        raise RuntimeError(f"{fn.__name__} failed")
    return torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr(_capsule(out.value, None, None))


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` for bfloat16 weights under a float32 ``x`` [..., K] (``models/cpu_layout.py``)."""
    define()
    return torch.ops.tandem_cpu.rows_linear(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])


def build_library(key_dir: str) -> str | None:
    """Compile ``SOURCES`` with the flags Inductor uses for this CPU's
    vector ISA into the shared ``library_path`` (unless a build of another key already did) and
    record that path in ``key_dir``; returns the library's directory, or None (nothing built)
    where Inductor finds no vector ISA. Concurrent builds take a file lock: one compiles, the
    others wait and use its library."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    if not isa:
        return None
    out = library_path(os.path.dirname(os.path.normpath(key_dir)), library_name())
    with open(os.path.join(key_dir, LINK), "w") as f:
        f.write(out)
    if os.path.exists(out):
        return os.path.dirname(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(f"{out}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(out):
            _compile_library(out, isa)
    return os.path.dirname(out)


def _compile_library(out: str, isa) -> None:
    """The sources compiled side by side (one compiler process each), then linked; the library
    is renamed into place whole."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    torch_dir = os.path.dirname(torch.__file__)
    lib_dir = os.path.join(torch_dir, "lib")
    cxx = get_cpp_compiler()
    flags = ["-O3", "-fPIC", "-std=c++20", "-w", *(f"-D{m}" for m in isa.build_macro()),
             *isa.build_arch_flags().split(), f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
             "-I", os.path.join(torch_dir, "include")]
    objects = [f"{out}.{os.path.basename(src)}.o" for src in SOURCES]
    compiles = [subprocess.Popen([cxx, *flags, "-c", src, "-o", obj], stderr=subprocess.PIPE, text=True)
                for src, obj in zip(SOURCES, objects)]
    tmp = f"{out}.{os.getpid()}.tmp"
    link = [cxx, "-shared", *objects, "-o", tmp, f"-Wl,-soname,{os.path.basename(out)}", "-L", lib_dir, "-ltorch_cpu",
            "-lc10", f"-Wl,-rpath,{lib_dir}"]
    try:
        for src, proc in zip(SOURCES, compiles):
            err = proc.communicate()[1]
            if proc.returncode != 0:
                sys.stderr.write(err[-4000:])
                raise RuntimeError(f"compiling {os.path.basename(src)} failed (exit {proc.returncode})")
        done = subprocess.run(link, capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-4000:])
            raise RuntimeError(f"linking {os.path.basename(out)} failed (exit {done.returncode})")
        os.replace(tmp, out)
    finally:
        for proc in compiles:  # one failed: do not leave the other running
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for path in (*objects, tmp):
            if os.path.exists(path):
                os.remove(path)


def use_rows_linear(program: torch.export.ExportedProgram) -> int:
    """Rewrite ``program``'s bias-free float32 or bfloat16 linears over a 2-D input and a weight
    of its dtype, column-major or (bfloat16) row-major, into ``rows_linear``, in place; returns
    how many calls of the library's ops the program makes (with those the model code made
    itself: ``rows_linear`` through ``linear``, ``paged_attention``)."""
    define()
    aten_linear, rows = torch.ops.aten.linear.default, torch.ops.tandem_cpu.rows_linear.default
    ours = (rows, torch.ops.tandem_cpu.paged_attention.default)
    n = 0
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target is aten_linear and _fits(node):
            node.target, node.args, node.kwargs = rows, tuple(node.args[:2]), {}
        n += node.op == "call_function" and node.target in ours
    program.graph_module.recompile()
    return n


def _fits(node) -> bool:
    x, w, *rest = node.args
    if any(b is not None for b in rest) or node.kwargs.get("bias") is not None:
        return False
    xv, wv = getattr(x, "meta", {}).get("val"), getattr(w, "meta", {}).get("val")
    if not isinstance(xv, torch.Tensor) or not isinstance(wv, torch.Tensor):
        return False
    row_major_bf16 = wv.dtype == torch.bfloat16 and wv.stride(1) == 1
    return (xv.dim() == 2 and wv.dim() == 2 and xv.dtype == wv.dtype and xv.dtype in (torch.float32, torch.bfloat16)
            and (wv.stride(0) == 1 or row_major_bf16))


def inductor_configs() -> dict:
    """AOTInductor settings for a program that calls the library's ops: their shims' declarations
    and the library to link (found through ``LIBRARY_PATH``, set by the caller to its directory)."""
    return {"aot_inductor.custom_ops_to_c_shims": {torch.ops.tandem_cpu.rows_linear.default: [SHIM],
                                                   torch.ops.tandem_cpu.paged_attention.default: [ATTENTION_SHIM]},
            "aot_inductor.custom_op_libs": [library_name()]}
