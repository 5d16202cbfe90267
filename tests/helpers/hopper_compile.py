"""Compile the engine's Triton kernels for the H200 (sm_90) on a machine without a GPU.

CI has no GPU, and Triton's interpreter accepts code its compiler rejects (a type the backend
cannot lower, a constexpr misused, a block that overflows shared memory), and it never reaches
the compiled-only branches (PDL's ``griddepcontrol``, RoPE's ``mul.rn``, libdevice ``tanh``).
So the kernels a change touches could first fail on the GPU machine, whose time is scarce.
This closes that gap in two halves:

``hopper_record.py``: while the engine runs under the interpreter, making its launch choices as
on the H200, note every kernel launch: one record per variant.

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

import importlib
import json
import sys
from typing import Any

import torch

TARGET = ("cuda", 90, 32)  # H100/H200: backend, compute capability 9.0, warp size
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB, opt-in maximum)
PDL_LEVELS = (0, 2)  # kernels/__init__.py: PDL_OFF, PDL_ON


def _decode(v: Any) -> Any:
    if isinstance(v, dict):
        dtype = getattr(torch, v["tensor"])
        base = torch.empty(64, dtype=dtype)  # torch's CPU allocations are 64-byte aligned
        return base[:32] if v["aligned16"] else base[1:33]
    return v


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


def main(argv: list[str]) -> int:
    """``record[-shapes] OUT.json CKPT_DIR`` (under the interpreter) or ``compile IN.json OUT.json``
    (without it; exit status 1 when a variant failed)."""
    if len(argv) == 3 and argv[0] in ("record", "record-shapes"):
        import tests.conftest  # noqa: F401 -- the test session's interpreter set-up and fast path
        from gpu_worker.kernels import gemv

        gemv.SKINNY_MIN_WEIGHT = 1  # the tiny test weights take the GEMV too
        if argv[0] == "record":
            from tests.helpers.hopper_record import record_engine as record
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
