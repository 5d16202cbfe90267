"""Device-side halves of programmatic dependent launch (see ``kernels/__init__.py``, "PDL").

``gdc_enter``: at ``PDL_ON``, wait for the previous kernel in the stream to complete (its writes
visible), then let the next kernel launch. Called by every program of
a kernel before its first read of what the previous kernel writes, and before its first write,
so the whole chain stays ordered (each kernel completes only after its predecessor did).
``prefetch_l2``: at ``PDL_ON``, a hint that pulls weight lines into L2 while the previous
kernel finishes; it changes no value. Both compile to nothing at ``PDL_OFF``. Under the
interpreter (one program at a time, nothing runs ahead) both are no-ops at every level, so CPU
tests can run a kernel's ``PDL_ON`` code path.
"""

from __future__ import annotations

from gpu_worker.kernels import interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: no kernel is defined, so nothing calls these
    triton = None
    gdc_enter = prefetch_l2 = None

if triton is not None and interpreting():

    @triton.jit
    def gdc_enter(PDL: tl.constexpr):
        pass

    @triton.jit
    def prefetch_l2(ptrs, PDL: tl.constexpr):
        pass

elif triton is not None:

    @triton.jit
    def gdc_enter(PDL: tl.constexpr):
        if PDL == 2:  # PDL_ON
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def prefetch_l2(ptrs, PDL: tl.constexpr):
        """One ``prefetch.global.L2`` per pointer (the GEMV passes one per 32-byte sector)."""
        if PDL == 2:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                                      is_pure=False, pack=1)
