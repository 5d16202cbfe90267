"""Our Triton kernels, one file per family; each has a torch reference in tests/unit.

Kernels run on CUDA tensors, and on CPU tensors under Triton's interpreter (CI checks them that
way at tiny sizes). ``use_triton(x)`` says whether a tensor takes the kernel path: on CUDA always
(when Triton imports); on the CPU only under the interpreter and where the worker asked for it
(``enable_cpu_kernels``: ``--attention-backend triton`` on the CPU), so the plain CPU path keeps
the torch ops.
"""

from __future__ import annotations

import functools

import torch

from gpu_worker.settings import triton_interpreting


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return triton_interpreting()


_CPU_KERNELS = [False]  # set by the worker when --attention-backend triton runs on the CPU


def enable_cpu_kernels(on: bool = True) -> None:
    """Route CPU tensors through the kernels too (needs the interpreter)."""
    _CPU_KERNELS[0] = on


def use_triton(x: torch.Tensor) -> bool:
    if not triton_available():
        return False
    if x.is_cuda:
        return True
    return interpreting() and _CPU_KERNELS[0]


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
# kernels take a ``PDL`` constexpr (``gdc_enter`` in ``gdc.py``):
#   PDL_OFF  nothing (forwards of more than PDL_MAX_TOKENS tokens, devices before sm_90, the
#            CPU interpreter);
#   PDL_ON   launched with PDL: before ``gdc_wait`` a program reads only what no kernel still
#            running can write (weights; step inputs written before the previous kernel
#            started) and writes nothing; it lets its own dependents launch only after its
#            wait has returned.
# So at most one kernel runs ahead, in its prologue (the GEMV prefetches its weights into L2
# there; decode attention loads its row's lengths, page entries and past keys), and every read of
# what the previous kernel writes still happens after that kernel completed. Only forwards of at
# most PDL_MAX_TOKENS tokens take it (one-row decode, MTP's verify and draft at one request):
# larger batches run faster without it (docs/decisions/pdl.md).
PDL_OFF, PDL_ON = 0, 2
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


def pdl(x: torch.Tensor) -> int:
    """The PDL level of a kernel reading ``x`` (tokens along dim 0): on for CUDA tensors of at
    most PDL_MAX_TOKENS tokens on sm_90+. A forward's kernels mostly see its token count; one
    that sees fewer rows (decode attention on a mixed batch's decode group) may take another
    level, which keeps the invariant: a kernel launched without PDL starts after its
    predecessor completed."""
    if pdl_level(x.shape[0]) == PDL_OFF or not x.is_cuda:
        return PDL_OFF
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return PDL_ON if _pdl_device(index) else PDL_OFF


def pdl_level(tokens: int) -> int:
    """``pdl``'s rule on a device that supports PDL (the sm_90 compile check,
    tests/helpers/hopper_record.py, records launches with it)."""
    return PDL_ON if tokens <= PDL_MAX_TOKENS else PDL_OFF


# --------------------------------------------------------------------------- tickets
# Split kernels that finish in one launch (split-K GEMV, split-KV decode attention) count their
# finished programs per output tile on a ticket; the last one to take it sums the partials and
# puts the ticket back to 0. Invariant: a buffer is all zeros between kernels, and launches
# sharing it never run concurrently: each stream a forward issues on has its own buffer (the
# forward's stream, and ``Beside``'s), and one stream runs its kernels one at a time (PDL lets a
# kernel run only its prologue, reads, before the previous one completed: tickets come after).
TICKETS = 1 << 16
_TICKETS: dict[tuple[torch.device, bool], torch.Tensor] = {}
_BESIDE = [False]  # inside a ``Beside`` block: launches take the second stream's buffer


def tickets(device: torch.device) -> torch.Tensor:
    """The zeroed int32 ticket buffer (TICKETS entries) of the device's stream that launches now,
    made on first use: an eager warm-up forward, before any graph capture."""
    key = (device, _BESIDE[0])
    t = _TICKETS.get(key)
    if t is None:
        t = _TICKETS[key] = torch.zeros(TICKETS, dtype=torch.int32, device=device)
    return t


def tickets_clear() -> bool:
    """Every ticket back at 0 (tests)."""
    return all(int(t.abs().sum()) == 0 for t in _TICKETS.values())


# --------------------------------------------------------------------------- a second stream
_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


class Beside:
    """A block of launches on the device's second stream, concurrent with what the caller issues
    after the block until ``join`` (in a CUDA graph: a fork and a join of two branches). At one to
    a few tokens a layer's small kernels are bound by launch latency, not bytes: beside another
    branch's weight streams they cost little. ``on`` False (or a CPU tensor) runs the block in
    place; the block's split kernels take the second buffer of tickets either way, so the CPU
    twin runs that path too.

    Invariants: the block reads only tensors the caller does not write before ``join``; its
    inputs (``keep``) stay referenced until ``join``, so the allocator cannot hand their memory
    to the caller's stream while the block may still read them; its outputs are made on the
    second stream, whose later blocks start after the caller's stream (``wait_stream``), so they
    are read before that memory is reused. No collective runs in a block (ranks must issue them
    in one order)."""

    def __init__(self, *keep: torch.Tensor, on: bool):
        self.keep, self.out = keep, None
        dev = keep[0].device
        self.stream = None
        if on and dev.type == "cuda":
            self.stream = _STREAMS.get(dev)
            if self.stream is None:
                self.stream = _STREAMS[dev] = torch.cuda.Stream(dev)
        self._ctx = None

    def __enter__(self) -> "Beside":
        _BESIDE[0] = True
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            self._ctx = torch.cuda.stream(self.stream)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        _BESIDE[0] = False
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            self._ctx = None

    def join(self):
        """The caller's stream waits for the block; returns what the block left in ``out``."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.stream = None
        self.keep = ()
        return self.out


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def log_compiles(log) -> None:
    """From now on (the worker calls this once ready, under ``DevSettings.log_compiles``), log
    every Triton kernel variant the serving path specialises, with the seconds it cost the step
    (a compile, or a load from Triton's disk cache): a variant compiled while serving is a
    latency spike a user sees."""
    if not triton_available():
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
