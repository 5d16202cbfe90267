"""``tests/conftest.py`` speeds up the Triton interpreter without changing a result: it skips the
re-patching of ``triton.language`` at nested ``@triton.jit`` helper calls (the launch's patch is
still in force), the int overflow check whose ``device_assert`` is off, and the per-call rebuild of
``_get_np_dtype``'s table. Kernels give the bits of Triton's own path, and the fast paths are taken."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")


def _fast_path():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("compiled Triton: no interpreter")
    from triton.runtime import interpreter

    fn = interpreter._patch_lang
    if not getattr(fn, "_tandem_fast", False):
        pytest.skip("this Triton's interpreter is not sped up by tests/conftest.py (or it is turned off)")
    return interpreter, fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nested_helpers_give_tritons_own_bits(dtype, monkeypatch):
    """rope_store with Gemma norms calls ``_rnd`` / ``_mul`` / ``_rotate`` / ``_head_norm`` /
    ``gdc_enter`` in every program, in both of its branches (q heads, KV heads + v norm)."""
    from gpu_worker.kernels.rope import NORM_GEMMA, rope_store
    from gpu_worker.models.config import RopeSpec
    from gpu_worker.models.layers import rope_inv_freq

    interpreter, fast = _fast_path()
    g = torch.Generator().manual_seed(3)
    t, hq, hkv, d = 5, 4, 2, 16
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    qw, kw = torch.randn(d, generator=g).to(dtype), torch.randn(d, generator=g).to(dtype)
    pos, loc = torch.tensor([0, 3, 7, 100, 511]), torch.tensor([9, 2, 4, 0, 11])
    inv = rope_inv_freq(d, RopeSpec(rope_type="default", theta=10000.0))

    def run():
        kc, vc = torch.zeros(12, hkv, d, dtype=dtype), torch.zeros(12, hkv, d, dtype=dtype)
        qo = rope_store(q, k, v, pos, inv, loc, kc, vc, norm=NORM_GEMMA, q_weight=qw, k_weight=kw, v_norm=True)
        return qo, kc, vc

    skipped = fast.skipped
    got = run()
    assert fast.skipped > skipped  # the fast path ran
    monkeypatch.setattr(interpreter, "_patch_lang", fast.__wrapped__)  # Triton's own path
    want = run()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[1].abs().sum() > 0 and got[2].abs().sum() > 0


def test_overflow_check_and_dtype_table_change_no_result(monkeypatch):
    """The interpreter's int overflow check returns early with ``debug`` off (its
    ``device_assert`` would discard it) and ``_get_np_dtype`` reads a table built once: a
    kernel with int and float arithmetic, loads and stores gives Triton's own bits, and every
    dtype maps as Triton maps it."""
    import triton.language as tl

    from gpu_worker.kernels.rope import NORM_GEMMA, rope_store
    from gpu_worker.models.config import RopeSpec
    from gpu_worker.models.layers import rope_inv_freq

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("compiled Triton: no interpreter")
    from triton.runtime import interpreter

    np_dtype = interpreter._get_np_dtype
    check = interpreter.interpreter_semantic.__dict__.get("binary_op_sanitize_overflow_impl")
    if not getattr(np_dtype, "_tandem_fast", False) or check is None:
        pytest.skip("this Triton's interpreter is not sped up by tests/conftest.py (or it is turned off)")
    types = [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32,
             tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv,
             tl.float8e4b8, tl.float8e4b15]
    types += [tl.pointer_type(t) for t in types] + [tl.block_type(t, [4, 2]) for t in types]
    types += [tl.block_type(tl.pointer_type(tl.float32), [8])]
    assert [np_dtype(t) for t in types] == [np_dtype.__wrapped__(t) for t in types]

    g = torch.Generator().manual_seed(5)
    t, hq, hkv, d = 3, 4, 2, 16
    q, k, v = (torch.randn(t, h, d, generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv))
    qw, kw = torch.randn(d, generator=g).to(torch.bfloat16), torch.randn(d, generator=g).to(torch.bfloat16)
    pos, loc = torch.tensor([0, 9, 300]), torch.tensor([5, 1, 7])
    inv = rope_inv_freq(d, RopeSpec(rope_type="default", theta=10000.0))

    def run():
        kc, vc = torch.zeros(8, hkv, d, dtype=torch.bfloat16), torch.zeros(8, hkv, d, dtype=torch.bfloat16)
        return rope_store(q, k, v, pos, inv, loc, kc, vc, norm=NORM_GEMMA, q_weight=qw, k_weight=kw, v_norm=True), kc, vc

    skipped = check.skipped
    got = run()
    assert check.skipped > skipped  # the early return ran
    monkeypatch.delattr(interpreter.interpreter_semantic, "binary_op_sanitize_overflow_impl")  # Triton's own
    monkeypatch.setattr(interpreter, "_get_np_dtype", np_dtype.__wrapped__)
    want = run()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
