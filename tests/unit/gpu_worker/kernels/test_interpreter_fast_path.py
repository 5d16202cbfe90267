"""``tests/conftest.py`` skips the Triton interpreter's re-patching of ``triton.language`` at
nested ``@triton.jit`` helper calls (the launch's patch is still in force): a kernel whose
programs call helpers many times gives the bits of Triton's own path, and the fast path is taken."""

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
