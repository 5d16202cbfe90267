"""Session-wide set-up shared by every test directory.

Without CUDA, our Triton kernels run under Triton's interpreter (numpy on the CPU), so the kernel
tests and the ``--attention-backend triton`` parity tests run in CI. The variable must be set
before any kernel module is imported: ``triton.jit`` reads it when it decorates.
"""

import os
import threading

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_as_read(interpreter) -> bool:
    """The interpreter is built as the fast path below assumes (read in Triton 3.9): a launch
    patches through ``_patch_lang`` and restores the scope it returns; a nested helper call
    patches through ``_patch_lang`` and drops the scope. Another Triton keeps its own path."""
    import inspect

    try:
        patch = inspect.getsource(interpreter._patch_lang)
        launch = inspect.getsource(interpreter.GridExecutor.__call__)
        nested = inspect.getsource(interpreter.InterpretedFunction.__call__)
    except (AttributeError, OSError, TypeError):
        return False
    return (hasattr(interpreter, "_LangPatchScope") and "_LangPatchScope()" in patch and "return scope" in patch
            and "patch_scope = _patch_lang(self.fn)" in launch and "patch_scope.restore()" in launch
            and "_patch_lang(self.fn)" in nested and "patch_scope" not in nested)


def _fast_nested_jit_calls() -> None:
    """Skip the interpreter's redundant re-patching of ``triton.language`` on nested calls.

    Triton's interpreter patches ``triton.language`` (every builtin of ``tl``, ``tl.tensor``,
    ``tl.math``, ... through ``inspect.getmembers``) when a kernel launch starts and restores it
    when the launch ends; but it also re-runs that whole patch at *every* call of a
    ``@triton.jit`` helper from inside a kernel (``InterpretedFunction.__call__``), about 0.4 ms
    each here. Our kernels call small helpers per program (``rope.py``'s ``_rnd`` / ``_rotate``
    / ``_head_norm``, ``gdc_enter``, ...): in the engine tests that re-patching was over half of
    the interpreter's time. Inside a launch, the launch's own patch is still in force, so a
    helper whose ``triton.language`` modules (``tl`` / ``tl.core`` seen from its globals) the
    launch already patched (or an earlier helper call of this launch did: Triton never restores
    those) would only set the same attributes again: that call is skipped. Any other call (the
    first helper of a launch that sees a module the kernel does not, e.g. ``tl.sum`` from
    ``triton.language.standard``, which sees ``tl.core``; no launch active; a Triton whose
    ``_patch_lang`` returns no restorable scope) runs Triton's own code unchanged, so the
    interpreted semantics are Triton's. ``TANDEM_TEST_SLOW_INTERPRETER=1`` turns this off.
    """
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("TANDEM_TEST_SLOW_INTERPRETER") == "1":
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "_tandem_fast", False) or not _interpreter_as_read(interpreter):
        return
    local = threading.local()  # per thread: the lang modules patched by the launch running there

    class _Kept:
        def restore(self) -> None:  # nothing was patched by this call
            pass

    kept = _Kept()

    def langs_of(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    def patch_lang(fn):
        active = getattr(local, "active", None)
        if active is not None:
            langs = langs_of(fn)
            if langs and langs <= active:  # nested helper: the launch's patch already covers it
                patch_lang.skipped += 1
                return kept
            # Triton's own path. Nobody restores a nested call's patches (Triton drops its
            # scope), so its modules stay patched to the end of this launch too.
            scope = original(fn)
            local.active = active | langs
            return scope
        scope = original(fn)  # a launch: GridExecutor restores this scope when the grid is done
        restore = getattr(scope, "restore", None)
        if restore is None:
            return scope
        local.active = langs_of(fn)

        def restore_and_end() -> None:
            local.active = None
            restore()

        scope.restore = restore_and_end
        return scope

    patch_lang._tandem_fast = True
    patch_lang.skipped = 0  # nested calls that skipped the re-patch (tests/unit/gpu_worker/kernels/test_interpreter_fast_path.py)
    patch_lang.__wrapped__ = original
    interpreter._patch_lang = patch_lang


_fast_nested_jit_calls()


def pytest_collection_modifyitems(items):
    """Modules marked ``heavy`` first (each keeps its order): under ``make test`` each process
    takes one module at a time in this order, so the longest start first and the processes end
    together instead of one finishing a long module alone."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


@pytest.fixture(autouse=True)
def _cpu_kernels_off_after_each_test():
    """A runner on the triton backend turns the kernels on for CPU tensors process-wide
    (``ModelRunner``: set per step) and leaves them on; a later test in the same process would
    then run its torch paths through the interpreter (40,000-row sampling tests: minutes)."""
    yield
    import sys

    kernels = sys.modules.get("gpu_worker.kernels")
    if kernels is not None:
        kernels.enable_cpu_kernels(False)
