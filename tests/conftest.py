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


def _patching_on() -> bool:
    """Tests run under the interpreter and ``TANDEM_TEST_SLOW_INTERPRETER=1`` is not asking for
    Triton's own, unpatched paths."""
    return os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("TANDEM_TEST_SLOW_INTERPRETER") != "1"


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
    if not _patching_on():
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


def _overflow_check_as_read(semantic_cls, interpreter) -> bool:
    """Triton 3.9 as read: the overflow check's only effect besides its two type assertions is a
    ``device_assert``, which returns at once unless ``options.debug``; the interpreter's
    options are built once, ``debug`` off; ``_get_np_dtype`` maps each dtype through a table
    it builds per call."""
    import inspect

    try:
        check = inspect.getsource(semantic_cls.binary_op_sanitize_overflow_impl)
        device_assert = inspect.getsource(semantic_cls.device_assert)
        np_dtype = inspect.getsource(interpreter._get_np_dtype)
        builder = inspect.getsource(interpreter.InterpreterBuilder.__init__)
    except (AttributeError, OSError, TypeError):
        return False
    return (check.count("self.device_assert(") == 1 and "return\n" in check
            and "not self.builder.options.sanitize_overflow" in check
            and "if not self.builder.options.debug:\n            return" in device_assert
            and "self.options = InterpreterOptions()" in builder and "np_types = {" in np_dtype
            and not interpreter.InterpreterOptions().debug)


def _fast_overflow_check_and_dtypes() -> None:
    """Two pieces of the interpreter's per-operation work that change no result.

    Every int ``+``, ``-`` and ``*`` of a kernel runs ``binary_op_sanitize_overflow_impl``: both
    operands cast to int64, the operation again, two comparisons and an ``and`` (a dozen tensor
    constructions), all to feed a ``device_assert`` that does nothing with ``debug`` off, as
    the interpreter's options always have it (on the GPU, too, the check is compiled in only
    under ``debug``). It was a quarter of the engine tests' interpreter time. Here the check
    keeps its type assertions and returns where ``device_assert`` would have discarded it;
    with ``debug`` on it is Triton's own. And ``_get_np_dtype`` (every load, store and cast)
    builds its 19-entry table at each call: here a lookup of the same table, Triton's own
    function for any other type. ``TANDEM_TEST_SLOW_INTERPRETER=1`` turns both off.
    """
    if not _patching_on():
        return
    try:
        import triton.language as tl
        from triton.language.semantic import TritonSemantic
        from triton.runtime import interpreter
    except ImportError:
        return
    semantic = getattr(interpreter, "interpreter_semantic", None)
    if semantic is None or getattr(interpreter._get_np_dtype, "_tandem_fast", False):
        return
    if not _overflow_check_as_read(TritonSemantic, interpreter):
        return
    own_check = TritonSemantic.binary_op_sanitize_overflow_impl.__get__(semantic)

    def overflow_check(lhs, rhs, binary_op):
        options = semantic.builder.options
        if options.debug:
            return own_check(lhs, rhs, binary_op)
        if lhs.type.scalar.int_bitwidth >= 64 or not options.sanitize_overflow:
            return None
        lhs_sca_ty, rhs_sca_ty = lhs.type.scalar, rhs.type.scalar
        assert lhs_sca_ty == rhs_sca_ty, f"expected matching operand types, got {lhs_sca_ty} and {rhs_sca_ty}"
        assert lhs_sca_ty.is_int(), f"expected integer type, got {lhs_sca_ty}"
        overflow_check.skipped += 1
        return None

    overflow_check.skipped = 0  # checks that returned early (test_interpreter_fast_path.py)
    semantic.binary_op_sanitize_overflow_impl = overflow_check  # this instance only: not the compiler's

    own_np_dtype = interpreter._get_np_dtype
    table = {}
    for ty in (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32,
               tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv,
               tl.float8e4b8, tl.float8e4b15):
        table[ty] = own_np_dtype(ty)
    pointer, block = tl.pointer_type, tl.block_type

    def np_dtype(tt_dtype):
        cls = type(tt_dtype)
        if cls is block:
            element = tt_dtype.element_ty
            if type(element) is pointer:
                return table_pointer
            found = table.get(element)
        elif cls is pointer:
            return table_pointer
        else:
            found = table.get(tt_dtype)
        return found if found is not None else own_np_dtype(tt_dtype)

    table_pointer = own_np_dtype(tl.pointer_type(tl.int8))
    np_dtype._tandem_fast = True
    np_dtype.__wrapped__ = own_np_dtype
    interpreter._get_np_dtype = np_dtype


_fast_overflow_check_and_dtypes()


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
