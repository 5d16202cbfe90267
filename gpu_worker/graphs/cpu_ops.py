"""The compiled CPU steps' own GEMM: ``tandem_cpu::rows_linear`` (``cpu_gemm.cpp``).

``rows_linear(x, w)`` is ``F.linear(x, w)`` for ``x`` [M, K] and a column-major ``w`` [N, K] of
one dtype, float32 or bfloat16 (``models/cpu_layout.py``). Up to 8 float32 rows (the target) or 4
bfloat16 ones (the draft) its kernel streams the weights as a one-row GEMV does, where MKL's
few-row kernel reads them in K strided streams that the prefetchers do not follow and torch's
bf16 GEMV runs AVX2 dot products (``docs/decisions/cpu.md``, "The programs' own GEMM"); past that
it is ``at::mm`` (MKL, oneDNN).

- Build side (``cpu_build.py``, its own process): ``build_library`` compiles ``cpu_gemm.cpp``
  into the key's directory, ``use_rows_linear`` rewrites an exported program's float32 and
  bfloat16 linears over column-major weights into the op, and ``inductor_configs`` has
  AOTInductor call the op's C shim directly (no dispatcher, no proxy executor) and link the
  library by name.
- Worker side (``cpu_steps.py``): ``load_library`` before the packages, so that their code finds
  the library (matched by its soname: nothing searches the file system at load).

The library's name carries a digest of its source, torch's version and the vector ISA, and it
lives beside the builds' key directories: builds of several model shapes compile it once, and
programs of two builds in one process bind the same library.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys

import torch

SHIM = "AOTITorchError aoti_torch_cpu_rows_linear(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0)"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_gemm.cpp")
_lib: list[torch.library.Library] = []  # the op's registration, once per process


LINK = "gemm_library"  # in a key's directory: the path of the library its programs link


def library_name() -> str:
    """``tandem_cpu_<digest>``: a digest of what the library's code depends on (its source, torch's
    version and headers, the vector ISA Inductor picks here). Build side only (imports Inductor)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    h = hashlib.sha256()
    with open(SOURCE, "rb") as f:
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
    return ctypes.CDLL(path) if os.path.exists(path) else None


def define() -> None:
    """The op's schema, shape function and eager body (for tracing and eager checks)."""
    if _lib:
        return
    lib = torch.library.Library("tandem_cpu", "DEF")
    lib.define("rows_linear(Tensor x, Tensor w) -> Tensor")
    lib.impl("rows_linear", lambda x, w: torch.mm(x, w.t()), "CPU")
    torch.library.register_fake("tandem_cpu::rows_linear", lambda x, w: x.new_empty((x.shape[0], w.shape[0])),
                                lib=lib)
    _lib.append(lib)


def build_library(key_dir: str) -> str | None:
    """Compile ``cpu_gemm.cpp`` with the flags Inductor uses for this CPU's vector ISA into the
    shared ``library_path`` (unless a build of another key already did) and record that path in
    ``key_dir``; returns the library's directory, or None (nothing built) where Inductor finds
    no vector ISA."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    if not isa:
        return None
    torch_dir = os.path.dirname(torch.__file__)
    lib_dir = os.path.join(torch_dir, "lib")
    out = library_path(os.path.dirname(os.path.normpath(key_dir)), library_name())
    with open(os.path.join(key_dir, LINK), "w") as f:
        f.write(out)
    if os.path.exists(out):
        return os.path.dirname(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.{os.getpid()}.tmp"  # renamed into place whole: concurrent builds may both compile
    cmd = [get_cpp_compiler(), "-O3", "-shared", "-fPIC", "-std=c++20", "-w",
           *(f"-D{m}" for m in isa.build_macro()), *isa.build_arch_flags().split(),
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
           "-I", os.path.join(torch_dir, "include"), SOURCE, "-o", tmp,
           f"-Wl,-soname,{os.path.basename(out)}", "-L", lib_dir, "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib_dir}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise RuntimeError(f"compiling {os.path.basename(SOURCE)} failed (exit {done.returncode})")
    os.replace(tmp, out)
    return os.path.dirname(out)


def use_rows_linear(program: torch.export.ExportedProgram) -> int:
    """Rewrite ``program``'s bias-free float32 or bfloat16 linears over a 2-D input and a
    column-major weight of its dtype into ``rows_linear``, in place; returns how many."""
    define()
    linear, rows = torch.ops.aten.linear.default, torch.ops.tandem_cpu.rows_linear.default
    n = 0
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target is linear and _fits(node):
            node.target, node.args, node.kwargs = rows, tuple(node.args[:2]), {}
            n += 1
    program.graph_module.recompile()
    return n


def _fits(node) -> bool:
    x, w, *rest = node.args
    if any(b is not None for b in rest) or node.kwargs.get("bias") is not None:
        return False
    xv, wv = getattr(x, "meta", {}).get("val"), getattr(w, "meta", {}).get("val")
    if not isinstance(xv, torch.Tensor) or not isinstance(wv, torch.Tensor):
        return False
    return (xv.dim() == 2 and wv.dim() == 2 and xv.dtype == wv.dtype and xv.dtype in (torch.float32, torch.bfloat16)
            and wv.stride(0) == 1)


def inductor_configs() -> dict:
    """AOTInductor settings for a program that calls ``rows_linear``: the shim's declaration and
    the library to link (found through ``LIBRARY_PATH``, set by the caller to its directory)."""
    return {"aot_inductor.custom_ops_to_c_shims": {torch.ops.tandem_cpu.rows_linear.default: [SHIM]},
            "aot_inductor.custom_op_libs": [library_name()]}
