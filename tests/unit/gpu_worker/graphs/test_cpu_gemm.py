"""The compiled CPU steps' GEMM library (``graphs/cpu_gemm.cpp``, ``graphs/cpu_amx.cpp``,
``graphs/cpu_split.cpp``) against
torch, path by path, at the bundled pair's shapes and at odd ones (K and N off the kernels'
blocks), called eagerly through the library's C shim (``graphs/cpu_ops.py: _eager``):

- column-major float32 weights, 1-8 rows (our kernel) and past that (MKL);
- column-major bfloat16 weights under bfloat16 rows, 1-4 rows (our kernel) and past that (oneDNN);
- row-major bfloat16 weights under float32 rows (AMX, three bfloat16 terms a value) and under
  bfloat16 rows (AMX, one term), 1-40 rows; where the CPU lacks AMX-BF16 the same cases run the
  library's ``at::mm`` fallback and must meet the same bounds;
- on two threads (a helper taking column blocks), the same bits as on one;
- other layouts and dtypes (``at::mm``).

Bounds: a float32 result within the dot product's rounding bound, ``n * 2^-24 * (|x| @ |w|^T)``
with n the number of float32 additions a value takes (K, or 3K for three terms), and the three
terms' mean error within 3x torch's float32 GEMM's; a bfloat16 result within the bound plus one
bfloat16 rounding (``2^-8`` of the value). Also the AMX layout
(``models/cpu_layout.py``): which weights it converts, that a ``Linear`` over it (biased or not)
returns the float32 model's products, and that a worker whose compiled steps do not load puts
its weights back in float32.
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker.graphs import cpu_ops
from gpu_worker.graphs.cpu_build import compiler_missing
from gpu_worker.models import cpu_layout
from gpu_worker.parallel.linear import Linear

pytestmark = pytest.mark.skipif(compiler_missing() is not None, reason="no C++ compiler: the library cannot be built")

BUNDLED = [(512, 256), (256, 256), (2048, 256), (256, 1024), (8192, 256)]  # (N, K): qkv, o, gate_up, down, head
ODD = [(100, 77), (33, 40), (70, 300), (17, 1), (1, 64)]
U32 = 2.0**-24  # float32's unit roundoff


def _data(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16().float()  # bfloat16 values, as a checkpoint's
    return x, w


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, adds: int, bf16_out: bool = False) -> None:
    ref = x.double() @ w.double().t()
    bound = adds * U32 * (x.double().abs() @ w.double().abs().t()) + 1e-30
    if bf16_out:  # one rounding of the float32 result to bfloat16
        bound = bound * (1 + 2.0**-8) + 2.0**-8 * ref.abs()
    assert out.shape == ref.shape
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), f"max err {err.max().item():.3g}, over bound at {(err > bound).sum().item()}"


def _rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.tandem_cpu.rows_linear(x, w)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 32])
@pytest.mark.parametrize("n,k", BUNDLED + ODD)
def test_float32_column_major(lib, m, n, k):
    x, w = _data(m, n, k, m + n + k)
    _check(_rows(x, w.t().contiguous().t()), x, w, k)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("n,k", BUNDLED + ODD)
def test_bfloat16_column_major(lib, m, n, k):
    x, w = _data(m, n, k, m + n + k)
    xb = x.bfloat16()
    out = _rows(xb, w.bfloat16().t().contiguous().t())
    assert out.dtype == torch.bfloat16
    _check(out, xb.float(), w, k, bf16_out=True)


@pytest.mark.parametrize("m", [1, 3, 4, 8, 16, 17, 32, 33, 40])
@pytest.mark.parametrize("n,k", BUNDLED + ODD)
def test_amx_float32_rows(lib, m, n, k):
    x, w = _data(m, n, k, m + n + k)
    out = _rows(x, w.bfloat16())  # row-major bfloat16 weights
    assert out.dtype == torch.float32
    _check(out, x, w, 3 * k + 2)
    # and as close as a float32 GEMM on average (within 1.05x here; without the third term 9-33x)
    ref = x.double() @ w.double().t()
    assert (out.double() - ref).abs().mean() <= 3 * ((x @ w.t()).double() - ref).abs().mean() + 1e-12


@pytest.mark.parametrize("m", [1, 4, 8, 16, 32, 40])
@pytest.mark.parametrize("n,k", BUNDLED + ODD)
def test_amx_bfloat16_rows(lib, m, n, k):
    x, w = _data(m, n, k, m + n + k)
    xb = x.bfloat16()
    out = _rows(xb, w.bfloat16())
    assert out.dtype == torch.bfloat16
    _check(out, xb.float(), w, k, bf16_out=True)


def test_amx_runs_where_the_cpu_has_it(lib):
    if not cpu_layout.amx_usable():
        pytest.skip("this CPU (or kernel) offers no AMX-BF16: the row-major bfloat16 cases ran the at::mm fallback")
    assert lib.tandem_cpu_amx_ready() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_threads_give_the_same_bits(lib, dtype):
    """The helper thread takes whole column blocks (cpu_split.cpp) of the AMX kernel and of our
    few-row kernels: every result equals the one thread's bit for bit, call after call (a claim of
    the wrong job would show here). Past our kernels' rows, at::mm runs on the caller's thread."""
    cases = []
    for m in (1, 3, 4, 8, 32, 40):
        for n, k in BUNDLED + [(100, 77), (300, 40)]:
            x, w = _data(m, n, k, m * n + k)
            cases.append((x.to(dtype), w.to(dtype).t().contiguous().t()))  # column-major
            if cpu_layout.amx_usable():
                cases.append((x.to(dtype), w.bfloat16()))  # the AMX layout
    one = [_rows(x, w) for x, w in cases]
    cpu_ops.gemm_threads(2)
    try:
        for _ in range(20):
            for (x, w), ref in zip(cases, one):
                assert torch.equal(_rows(x, w), ref)
    finally:
        cpu_ops.gemm_threads(1)


def test_other_layouts_and_dtypes_fall_back(lib):
    x, w = _data(6, 70, 48, 0)
    _check(_rows(x, w), x, w, 48)  # row-major float32: at::mm
    _check(_rows(x, w.bfloat16().t().contiguous().t()), x, w, 48)  # bfloat16 column-major under float32 rows
    xs = torch.randn(48, 6).t()  # rows with a non-unit stride along K
    _check(_rows(xs, w.t().contiguous().t()), xs, w, 48)
    _check(_rows(xs, w.bfloat16()), xs, w, 48)
    assert _rows(x[:0], w.bfloat16()).shape == (0, 70)


def _tiny(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.qkv, model.plain = Linear(64, 96, bias=False), torch.nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        model.qkv.weight.copy_(model.qkv.weight.bfloat16().float())
    return model


def test_amx_layout(lib):
    model = _tiny(0)
    assert cpu_layout.bf16_exact(model)  # the plain nn.Linear is not converted: its values do not matter
    w32 = model.qkv.weight.detach().clone()
    cpu_layout.amx_projections(model)
    assert model.qkv.weight.dtype == torch.bfloat16 and model.qkv.weight.is_contiguous()
    assert model.plain.weight.dtype == torch.float32 and model.plain.weight.stride() == (1, 32)
    x = torch.randn(3, 5, 64)
    y = model.qkv(x)  # float32 rows, bfloat16 weight: the library's GEMM
    assert y.dtype == torch.float32 and y.shape == (3, 5, 96)
    _check(y.reshape(15, 96), x.reshape(15, 64), w32, 3 * 64 + 2)
    inexact = _tiny(1)
    with torch.no_grad():
        inexact.qkv.weight[0, 0] += 1e-4
    assert not cpu_layout.bf16_exact(inexact)


def test_a_biased_linear_over_the_amx_layout_adds_its_float32_bias(lib):
    """Qwen2's q/k/v (and Llama's with ``attention_bias``) carry a bias: it stays in the model's
    float32 and is added to the library's product."""
    torch.manual_seed(2)
    lin = Linear(64, 48, bias=True)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.bfloat16().float())
    w32, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    model = torch.nn.Module()
    model.qkv = lin
    cpu_layout.amx_projections(model)
    assert lin.weight.dtype == torch.bfloat16 and lin.bias.dtype == torch.float32
    x = torch.randn(5, 64)
    y = lin(x)
    assert y.dtype == torch.float32
    _check(y - b, x, w32, 3 * 64 + 2)


def test_the_float_layout_undoes_the_amx_layout(lib):
    """Where the compiled steps do not load (``gpu_worker/main.py``), the weights go back to the
    model's dtype, column-major, with their values unchanged (they were bfloat16 values)."""
    model = _tiny(3)
    w32 = model.qkv.weight.detach().clone()
    cpu_layout.amx_projections(model)
    cpu_layout.float_projections(model, torch.float32)
    assert model.qkv.weight.dtype == torch.float32 and model.qkv.weight.stride() == (1, 96)
    assert torch.equal(model.qkv.weight, w32)
    assert model.plain.weight.dtype == torch.float32 and model.plain.weight.stride() == (1, 32)


def test_an_engine_whose_steps_do_not_load_keeps_float32_weights(ckpts, monkeypatch):
    """The worker takes the AMX layout before the compiled steps load; where they then do not
    (a build that failed), its eager steps get the float32 column-major layout back."""
    from gpu_worker import main
    from tests.helpers.inproc import InProcEngine

    monkeypatch.setattr(main, "amx_usable", lambda: True)
    monkeypatch.setattr(main, "bf16_exact", lambda model: True)
    monkeypatch.setattr(main, "compiler_missing", lambda: None)
    monkeypatch.setattr(main, "ensure_built", lambda spec: None)
    eng = InProcEngine(ckpts["llama"], compiled=True)
    assert eng.runner.graphs is None
    for mod in eng.runner.target.modules():
        if isinstance(mod, Linear):
            assert mod.weight.dtype == torch.float32 and mod.weight.stride() == (1, mod.weight.shape[0])
    eng.submit("a", [5, 6, 7, 8], max_new_tokens=3, ignore_eos=True)
    eng.run()
    assert len(eng.tokens["a"]) == 3
