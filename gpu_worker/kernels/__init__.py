"""Our Triton kernels, one file per family; each has a torch reference in tests/unit.

Kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (CI checks them
that way at tiny sizes). ``use_triton(x)`` says whether a tensor should take the kernel path:
on CUDA always (when Triton imports), on the CPU only when the interpreter is switched on and
``TANDEM_TRITON_CPU=1`` (or ``--attention-backend triton``) asks for it, so the plain CPU path
keeps the torch reference ops.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


_CPU_KERNELS = [False]  # set by the worker when --attention-backend triton runs on the CPU


def enable_cpu_kernels(on: bool = True) -> None:
    """Route CPU tensors through the kernels too (needs the interpreter)."""
    _CPU_KERNELS[0] = on


def use_triton(x: torch.Tensor) -> bool:
    if not triton_available():
        return False
    if x.is_cuda:
        return True
    return interpreting() and (_CPU_KERNELS[0] or os.environ.get("TANDEM_TRITON_CPU") == "1")


def fused_glue() -> bool:
    """The step-glue kernels (on unless ``TANDEM_FUSED_GLUE=0``): the MTP draft loop's head
    (``decode_inputs.draft_inputs``), Gemma's scaled embedding (``embed.embed_scaled``) and
    final softcap (``softcap.softcap_float``) as one kernel each instead of torch's ops. On by
    default since they passed tests/gpu on the H200 (2026-12-05; BENCHMARKS.md): 9 µs less a
    Gemma-4 9B MTP step, nothing measurable on its plain step. ``0`` gives torch's ops (the
    same values; tests/unit/test_fused_glue_switch.py). Read at each call."""
    return os.environ.get("TANDEM_FUSED_GLUE", "1") != "0"


def _fix_interpreter_index() -> None:
    """Triton <= 3.6's interpreter turns a scalar into a Python int with ``int(array)``, an error
    since numpy 2.4 for its 1-element arrays (so ``range(lo, hi)`` over loaded bounds failed);
    Triton 3.9 squeezes first. Wrap its tensor patcher to do the same."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_tandem_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._tandem_fixed = True
    interpreter._patch_lang_tensor = patched


if interpreting() and triton_available():
    _fix_interpreter_index()


# --------------------------------------------------------------------------- PDL
# Programmatic dependent launch (Hopper+): a kernel launched with ``launch_pdl=True`` may start
# while the kernel before it in the stream still runs, and CUDA graphs keep that edge. Our
# kernels take a ``PDL`` constexpr, one of three levels (``gdc_enter`` in ``gdc.py``):
#   PDL_OFF     nothing (``TANDEM_PDL=0``, forwards past the token limit, the CPU interpreter);
#   PDL_TRIGGER launched normally, but lets the next kernel launch as soon as it starts, so a
#               PDL kernel after it can run its prologue early;
#   PDL_ON      launched with PDL: before ``gdc_wait`` a program reads only what no kernel still
#               running can write (weights; step inputs written before the previous kernel
#               started) and writes nothing; it lets its own dependents launch only after its
#               wait has returned.
# So at most one kernel runs ahead, in its prologue (the GEMV prefetches its weights into L2
# there; decode attention loads its row's lengths, page entries and past keys), and every read of
# what the previous kernel writes still happens after that kernel completed. Every kernel but
# the previous one has completed when a PDL kernel starts: the previous one started only after
# its own predecessor completed (normal launch) or after its wait (PDL).
# ``TANDEM_PDL``: ``1`` (default) every kernel, ``0`` none, or a list of the kernel kinds to
# launch with PDL (``PDL_KINDS``, joined by ``,`` or ``+``; the others trigger). Only forwards of
# at most ``TANDEM_PDL_MAX_TOKENS`` tokens (default 4: one-row decode, MTP's verify and draft at
# one request) take it. On the H200 (BENCHMARKS.md, 2026-12-04) it made the 8B one-row decode
# step 3 % faster (4.340 -> 4.202 ms) once the GEMV's pre-wait prefetch fit in L2, and the
# 64-row step 6 % and the Qwen3 recipe 5 % slower: their kernels run without it.
PDL_OFF, PDL_TRIGGER, PDL_ON = 0, 1, 2
PDL_KINDS = ("norm", "gemv", "attn", "rope", "act")
PDL_MAX_TOKENS = 4


@functools.lru_cache(maxsize=None)
def _pdl_device(index: int) -> bool:
    if not triton_available():
        return False
    try:
        import triton.language as tl

        if not hasattr(tl.extra.cuda, "gdc_wait"):
            return False
    except (ImportError, AttributeError):
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.lru_cache(maxsize=None)
def pdl_kinds(setting: str) -> frozenset[str]:
    """The kinds ``TANDEM_PDL=setting`` launches with PDL (ValueError naming the variable)."""
    if setting in ("", "0"):
        return frozenset()
    if setting == "1":
        return frozenset(PDL_KINDS)
    kinds = frozenset(k.strip() for k in setting.replace("+", ",").split(",") if k.strip())
    bad = sorted(kinds - set(PDL_KINDS))
    if bad:
        raise ValueError(f"TANDEM_PDL: expected 0, 1 or a list of {', '.join(PDL_KINDS)} joined by , or +; got {bad}")
    return kinds


@functools.lru_cache(maxsize=None)
def _max_tokens(setting: str) -> int:
    if not setting:
        return PDL_MAX_TOKENS
    if not setting.isdigit():
        raise ValueError(f"TANDEM_PDL_MAX_TOKENS: expected a non-negative integer, got {setting!r}")
    return int(setting)


def pdl(x: torch.Tensor, kind: str) -> int:
    """The PDL level of a ``kind`` kernel reading ``x`` (tokens along dim 0; CUDA, sm90+, switched
    on, at most ``TANDEM_PDL_MAX_TOKENS`` tokens). A forward's kernels mostly see its token count;
    one that sees fewer rows (decode attention on a mixed batch's decode group) may take
    another level, which keeps the invariant: a kernel launched without PDL starts after its
    predecessor completed and lets nothing start early unless it triggers.
    Read at each launch, so a process can capture graphs both ways (benchmarks, tests)."""
    level = pdl_level(x.shape[0], kind)  # first: a bad setting is an error on any device
    if level == PDL_OFF or not x.is_cuda:
        return PDL_OFF
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return level if _pdl_device(index) else PDL_OFF


def pdl_level(tokens: int, kind: str) -> int:
    """``pdl``'s rule on a device that supports PDL: by the environment, the kind and the token
    count (the sm_90 compile check, tests/helpers/hopper_compile.py, records launches with it)."""
    kinds = pdl_kinds(os.environ.get("TANDEM_PDL", "1"))
    limit = _max_tokens(os.environ.get("TANDEM_PDL_MAX_TOKENS", ""))
    if not kinds or tokens > limit:
        return PDL_OFF
    return PDL_ON if kind in kinds else PDL_TRIGGER


# --------------------------------------------------------------------------- tickets
# Split kernels that finish in one launch (split-K GEMV, split-KV decode attention) count their
# finished programs per output tile on a ticket; the last one to take it sums the partials and
# puts the ticket back to 0. Invariant: the buffer is all zeros between kernels, and launches
# sharing it never run concurrently (the worker issues every forward on one stream; PDL lets a
# kernel run only its prologue, reads, before the previous one completed: tickets come after).
TICKETS = 1 << 16
_TICKETS: dict[torch.device, torch.Tensor] = {}


def tickets(device: torch.device) -> torch.Tensor:
    """The device's zeroed int32 ticket buffer (TICKETS entries), made on first use: an eager
    warm-up forward, before any graph capture."""
    t = _TICKETS.get(device)
    if t is None:
        t = _TICKETS[device] = torch.zeros(TICKETS, dtype=torch.int32, device=device)
    return t


def tickets_clear() -> bool:
    """Every ticket back at 0 (tests)."""
    return all(int(t.abs().sum()) == 0 for t in _TICKETS.values())


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def log_compiles(log) -> None:
    """TANDEM_LOG_COMPILES=1: from now on (the worker calls this once ready), log every Triton
    kernel variant the serving path specialises, with the seconds it cost the step (a compile,
    or a load from Triton's disk cache). Diagnoses the start-up transient (BENCHMARKS.md)."""
    if os.environ.get("TANDEM_LOG_COMPILES", "0") == "0" or not triton_available():
        return
    import time

    try:
        from triton import knobs

        runtime = knobs.runtime
        assert hasattr(runtime, "jit_cache_hook") and hasattr(runtime, "jit_post_compile_hook")
    except (ImportError, AssertionError):
        log.warning("TANDEM_LOG_COMPILES: this Triton has no JIT hooks (triton.knobs.runtime)")
        return
    started: dict = {}

    def before(**kw):
        started[str(kw.get("key"))] = time.perf_counter()
        return False  # a true value would skip the compile

    def after(**kw):
        dt = time.perf_counter() - started.pop(str(kw.get("key")), time.perf_counter())
        log.warning("triton variant specialised while serving (%.3f s): %s", dt, str(kw.get("repr"))[:400])

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
