"""Device-side halves of programmatic dependent launch (see ``kernels/__init__.py``, "PDL").

``gdc_enter``: wait for the previous kernel in the stream to complete (its writes visible), then
let the next kernel launch. Called by every program of a PDL kernel before its first read of
activations or its first write, so the whole chain stays ordered (each kernel completes only
after its predecessor did). ``prefetch_l2``: a hint that pulls weight lines into L2 while the
previous kernel finishes; it changes no value. Both compile to nothing with ``PDL=False`` (the
CPU interpreter path).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: no kernel is defined, so nothing calls these
    triton = None
    gdc_enter = prefetch_l2 = None

if triton is not None:

    @triton.jit
    def gdc_enter(PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def prefetch_l2(ptrs, PDL: tl.constexpr):
        """One ``prefetch.global.L2`` per pointer (the GEMV passes one per 32-byte sector)."""
        if PDL:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                                      is_pure=False, pack=1)
