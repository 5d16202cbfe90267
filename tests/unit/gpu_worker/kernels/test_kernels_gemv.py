"""The skinny decode GEMM (kernels/gemv.py) against fp32 matmul — plain, gated (the MLP's
``act(gate) * up`` as its epilogue) and split-K (one kernel, tickets) — and the dispatch rules
that decide where it replaces F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.kernels import enable_cpu_kernels, tickets_clear
from gpu_worker.kernels import gemv as G

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k,block_n,block_k", [(70, 300, 16, 128), (8, 64, 8, 64), (33, 1000, 32, 256)])
def test_gemv_matches_matmul(m, n, k, block_n, block_k, splits, dot):
    """The FMA kernel and the tensor-core one (``dot``: tiles of at least 16 rows of W)."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEV)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16).to(DEV)
    block_n = max(block_n, 16) if dot else block_n
    y = G.gemv(x, w, splits=splits, block_n=block_n, block_k=block_k, num_stages=2, dot=dot)
    ref = x.float() @ w.float().t()
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    # one rounding of an fp32 sum: within a bf16 ulp of the exact product (plus fp32 reordering)
    # (the interpreter truncates to bf16 where compiled code rounds: allow a whole ulp)
    ulp = ref.abs().clamp_min(1.0) * 2.0**-7
    assert ((y.float() - ref).abs() <= ulp + 1e-3 * ref.abs().max()).all()


@pytest.mark.parametrize("m,splits", [(20, 1), (64, 2)])
def test_dot_gemv_takes_decode_batches(m, splits):
    """The tensor-core variant pads x to a power of two past 16 rows (up to DOT_MAX_M: the
    sweep's ``wide`` part times it at 32 and 64 rows)."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 96, generator=g).to(torch.bfloat16).to(DEV)
    w = torch.randn(40, 96, generator=g).to(torch.bfloat16).to(DEV)
    y = G.gemv(x, w, splits=splits, block_n=16, block_k=32, num_stages=2, dot=True)
    ref = x.float() @ w.float().t()
    ulp = ref.abs().clamp_min(1.0) * 2.0**-7
    assert y.shape == (m, 40) and ((y.float() - ref).abs() <= ulp + 1e-3 * ref.abs().max()).all()
    assert tickets_clear()


def test_gemv_strided_rows():
    """x may be a row view of a wider buffer (unit column stride only)."""
    base = torch.randn(3, 200).to(torch.bfloat16).to(DEV)
    x = base[:, :128]
    w = torch.randn(24, 128).to(torch.bfloat16).to(DEV)
    y = G.gemv(x, w, block_n=8, block_k=64)
    torch.testing.assert_close(y.float(), (x.float() @ w.float().t()), rtol=1e-2, atol=1e-1)


def test_linear_dispatch(monkeypatch):
    """A bf16 row through a large-enough weight takes the kernel; float32, small weights and a
    bias take F.linear."""
    calls = []
    monkeypatch.setattr(G, "gemv", lambda x, w, **kw: calls.append(x.shape) or F.linear(x, w))
    monkeypatch.setattr(G, "SKINNY_MIN_WEIGHT", 64 * 32)
    enable_cpu_kernels(True)
    try:
        w = torch.randn(64, 32).to(torch.bfloat16).to(DEV)
        G.linear(torch.randn(1, 32).to(torch.bfloat16).to(DEV), w)
        assert calls == [(1, 32)]
        G.linear(torch.randn(1, 32).to(DEV), w.float())  # float32: cuBLAS
        G.linear(torch.randn(1, 32).to(torch.bfloat16).to(DEV), w[:32])  # too small: cuBLAS
        G.linear(torch.randn(1, 32).to(torch.bfloat16).to(DEV), w, torch.zeros(64, dtype=w.dtype, device=DEV))
        assert calls == [(1, 32)]
    finally:
        enable_cpu_kernels(False)


def test_several_rows_dispatch(monkeypatch):
    """Up to GEMV_MAX_M rows (4: MTP's verify at one request) take the GEMV: big weights the
    tensor-core variant (BIG_CONFIG) at every row count, smaller ones the FMA kernel at one row
    and ROWS_CONFIG above; five rows take cuBLAS."""
    calls = []
    monkeypatch.setattr(G, "gemv", lambda x, w, **kw: calls.append((x.shape[0], w.shape[0], kw)) or F.linear(x, w))
    monkeypatch.setattr(G, "SKINNY_MIN_WEIGHT", 64 * 32)
    monkeypatch.setattr(G, "BIG_WEIGHT", 128 * 32)
    small = torch.randn(64, 32).to(torch.bfloat16).to(DEV)
    big = torch.randn(128, 32).to(torch.bfloat16).to(DEV)
    rows = [torch.randn(m, 32).to(torch.bfloat16).to(DEV) for m in (1, 2, 4, 5)]
    enable_cpu_kernels(True)
    try:
        for x in rows:
            G.linear(x, small)
            G.linear(x, big)
        cfg = {(m, n): {k: v for k, v in kw.items() if k != "splits"} for m, n, kw in calls}
        assert sorted(cfg) == [(m, n) for m in (1, 2, 4) for n in (64, 128)]  # five rows: cuBLAS
        assert cfg[1, 64] == G.CONFIG and cfg[2, 64] == cfg[4, 64] == G.ROWS_CONFIG
        assert cfg[1, 128] == cfg[2, 128] == cfg[4, 128] == G.BIG_CONFIG
    finally:
        enable_cpu_kernels(False)


def _gated_ref(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """HF's MLP middle in the model dtype (act rounded, then the product rounded)."""
    from gpu_worker.models.layers import activation

    g, u = gate_up.float().chunk(2, dim=-1)
    a = activation(act)(g).to(gate_up.dtype)
    return (a.float() * u).to(gate_up.dtype)


@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("m", [1, 3])
def test_gated_gemv_is_gemv_then_act(act, m, splits, dot):
    """``act(x @ gate^T) * (x @ up^T)`` from one launch has exactly the bits of the plain GEMV
    (same splits, so the same sums) followed by the activation kernel, and matches the float
    reference within the roundings; ragged N and K tiles (N = 70 is not a multiple of the
    tensor-core tile's 16 gate rows), fresh inputs per case."""
    from gpu_worker.kernels.activation import gated_act

    g = torch.Generator().manual_seed(7 + m + 10 * splits)
    k, n = 300, 70
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.randn(2 * n, k, generator=g) * 0.3).to(torch.bfloat16).to(DEV)
    block_n = 32 if dot else 16
    y = G.gemv(x, w, act=act, splits=splits, block_n=block_n, block_k=64, num_stages=2, dot=dot)
    gate_up = G.gemv(x, w, splits=splits, block_n=block_n, block_k=64, num_stages=2, dot=dot)
    enable_cpu_kernels(True)
    try:
        two_step = gated_act(gate_up[:, :n], gate_up[:, n:], act)
    finally:
        enable_cpu_kernels(False)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert torch.equal(y, two_step)
    ref = _gated_ref((x.float() @ w.float().t()).to(torch.bfloat16), act).float()
    # the inputs of act and of the product are each within an ulp (the interpreter truncates)
    torch.testing.assert_close(y.float(), ref, rtol=2.0**-5, atol=5e-2)
    assert tickets_clear()


@pytest.mark.parametrize("m", [5, 20, 64])
def test_gated_dot_takes_decode_batches(m):
    """Past GEMV_MAX_M rows the tensor-core GEMV reads its row count at run time (one variant
    per padded width) and the gated epilogue gives the bits of the GEMV then the activation."""
    from gpu_worker.kernels.activation import gated_act

    g = torch.Generator().manual_seed(m)
    k, n = 200, 40
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.randn(2 * n, k, generator=g) * 0.3).to(torch.bfloat16).to(DEV)
    cfg = dict(block_n=32, block_k=64, num_stages=2, dot=True)
    y = G.gemv(x, w, act="silu", **cfg)
    plain = G.gemv(x, w, **cfg)
    enable_cpu_kernels(True)
    try:
        two_step = gated_act(plain[:, :n], plain[:, n:], "silu")
    finally:
        enable_cpu_kernels(False)
    assert y.shape == (m, n) and torch.equal(y, two_step)
    torch.testing.assert_close(plain.float(), x.float() @ w.float().t(), rtol=2.0**-6, atol=2e-2)


def test_split_k_is_deterministic_and_leaves_tickets_clear():
    """Every launch of a split-K GEMV gives the same bits (the partials are summed in split
    order, whichever program finishes last) and puts every ticket back to 0, so launches in a
    row (a CUDA graph replaying one layer after another) never see a stale count."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 700, generator=g).to(torch.bfloat16).to(DEV)
    ws = [torch.randn(40, 700, generator=g).to(torch.bfloat16).to(DEV) for _ in range(3)]
    first = [G.gemv(x, w, splits=4, block_n=8, block_k=64) for w in ws]
    assert tickets_clear()
    again = [G.gemv(x, w, splits=4, block_n=8, block_k=64) for w in ws]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    # more splits than K blocks: clamped, no empty split waits for a ticket it never gets
    y = G.gemv(x, ws[0], splits=64, block_n=8, block_k=256)
    torch.testing.assert_close(y.float(), x.float() @ ws[0].float().t(), rtol=2e-2, atol=0.5)
    assert tickets_clear()


def test_linear_takes_split_k_past_max_k(monkeypatch):
    """One row through a weight with K > SKINNY_MAX_K takes the split-K GEMV (LONG_K_SPLITS)."""
    calls = []
    real = G.gemv
    monkeypatch.setattr(G, "gemv", lambda x, w, **kw: calls.append(kw.get("splits", 1)) or real(x, w, **kw))
    monkeypatch.setattr(G, "SKINNY_MIN_WEIGHT", 1)
    monkeypatch.setattr(G, "SKINNY_MAX_K", 64)
    torch.manual_seed(2)
    w = torch.randn(16, 256).to(torch.bfloat16).to(DEV)
    x = torch.randn(1, 256).to(torch.bfloat16).to(DEV)
    enable_cpu_kernels(True)
    try:
        y = G.linear(x, w)
        G.linear(x[:, :64], w[:, :64].contiguous())
        assert calls == [G.LONG_K_SPLITS, 1]
    finally:
        enable_cpu_kernels(False)
    torch.testing.assert_close(y.float(), x.float() @ w.float().t(), rtol=2e-2, atol=0.2)


def test_gated_linear_dispatch(monkeypatch):
    """The activation rides in gate_up's GEMV wherever that is the tensor-core kernel (a big
    weight at 1-4 rows, 2-4 rows through a smaller one, a decode batch of up to 64 rows through a
    big one) and nowhere else. None means the caller runs the merged projection and the
    activation separately."""
    monkeypatch.setattr(G, "SKINNY_MIN_WEIGHT", 16 * 32)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(32, 32, generator=g).to(torch.bfloat16).to(DEV)
    one = torch.randn(1, 32, generator=g).to(torch.bfloat16).to(DEV)
    two = torch.randn(2, 32, generator=g).to(torch.bfloat16).to(DEV)
    calls = []
    real = G.gemv
    monkeypatch.setattr(G, "gemv", lambda x, w, **kw: calls.append((x.shape[0], kw.get("dot", False))) or real(x, w, **kw))

    def check(x, big=False):
        monkeypatch.setattr(G, "BIG_WEIGHT", w.numel() if big else 48 << 20)
        calls.clear()
        out = G.gated_linear(x, w, "silu")
        if out is not None:  # within an ulp of gate / up each (the interpreter truncates), then the product
            torch.testing.assert_close(out.float(), _gated_ref(F.linear(x, w), "silu").float(), rtol=2.0**-5, atol=5e-2)
            assert out.shape == (x.shape[0], 16)
            return calls[0][1]  # the tensor-core kernel took it
        return None

    if DEV == "cpu":
        assert check(two) is None  # kernels off: the torch reference path
    enable_cpu_kernels(True)
    try:
        assert check(one) is None  # one row through a small weight: the FMA GEMV, then the activation
        assert check(one, big=True) is True  # a big weight: the tensor-core GEMV
        assert check(two) is True  # 2-4 rows: tensor core whatever the size
        eight = torch.randn(8, 32, generator=g).to(torch.bfloat16).to(DEV)
        assert check(eight) is None  # a decode batch through a small weight: cuBLAS
        assert check(eight, big=True) is True  # ... through a big one: the gated GEMV
        assert check(torch.randn(65, 32).to(torch.bfloat16).to(DEV), big=True) is None  # past 64 rows
        assert G.gated_linear(one, w, "relu2") is None
    finally:
        enable_cpu_kernels(False)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("big,rows", [(True, 1), (False, 3)])
def test_gated_mlp_equals_unfused(monkeypatch, act, big, rows):
    """GatedMLP at 1-4 rows takes the gated tensor-core GEMV (a big weight, or several rows),
    then a split-K down, and gives exactly the unfused kernels' output."""
    from gpu_worker.models import layers as L

    monkeypatch.setattr(G, "SKINNY_MIN_WEIGHT", 1)
    monkeypatch.setattr(G, "SKINNY_MAX_K", 64)
    if big:
        monkeypatch.setattr(G, "BIG_WEIGHT", 1)
    torch.manual_seed(3)
    mlp = L.GatedMLP(64, 96, act).to(torch.bfloat16).to(DEV)
    x = torch.randn(rows, 64).to(torch.bfloat16).to(DEV)
    calls = []
    real = G.gemv
    monkeypatch.setattr(G, "gemv", lambda *a, **kw: calls.append((kw.get("act"), kw.get("splits", 1))) or real(*a, **kw))
    enable_cpu_kernels(True)
    try:
        fused = mlp(x)
        assert calls == [(act, 1), (None, G.LONG_K_SPLITS)]  # gated gate_up, then down (K = 96 > 64) split
        monkeypatch.setattr(L, "gated_linear", lambda *a: None)
        unfused = mlp(x)
    finally:
        enable_cpu_kernels(False)
    assert torch.equal(fused, unfused)


def test_short_k_splits_fill_the_gpu():
    """Short-K launches split K only when they have fewer column tiles than the GPU has SMs (132
    off CUDA), into FILL_PER_SM programs per SM, each split at least MIN_SPLIT_TILES K tiles."""
    cpu = torch.device("cpu")
    cfg = G.CONFIG  # 8 rows x 512 K a tile
    want = G.FILL_PER_SM * 132
    assert G.FILL_PER_SM == 3
    assert G.short_k_splits(G.launch_tiles(8192, cfg), 3840, 512, cpu) == 1  # Gemma-9B qkv: 1024 tiles
    assert G.short_k_splits(G.launch_tiles(3840, cfg), 4096, 512, cpu) == 1  # Gemma-9B o: 480 tiles
    assert G.short_k_splits(G.launch_tiles(8192, G.ROWS_CONFIG), 3840, 256, cpu) == 1  # 4-row qkv: 256 tiles
    assert G.short_k_splits(132, 4096, 512, cpu) == 1  # a tile per SM
    assert G.short_k_splits(128, 4096, 512, cpu) == 4 == -(-want // 128)  # assistant o / down
    assert G.short_k_splits(128, 8192, 512, cpu) == 4  # the assistant's full-layer o
    assert G.short_k_splits(128, 2048, 512, cpu) == 2  # Qwen3-0.6B o: K = 4 tiles, 2 splits at most
    assert G.short_k_splits(128, 512, 512, cpu) == 1  # one K tile: nothing to split
    assert G.short_k_splits(G.launch_tiles(3840, G.ROWS_CONFIG), 4096, 256, cpu) == 4  # the 4-row verify's o
    assert G.launch_tiles(2 * 4096, cfg, gated=True) == 512 and G.launch_tiles(2 * 4096, G.BIG_CONFIG, gated=True) == 128


def test_narrow_projection_takes_split_k(monkeypatch):
    """One row through a narrow short-K weight (few column tiles) goes through the split-K GEMV
    and still matches the fp32 product; the tickets are left clear."""
    calls = []
    real = G.gemv
    monkeypatch.setattr(G, "gemv", lambda x, w, **kw: calls.append(kw["splits"]) or real(x, w, **kw))
    monkeypatch.setattr(G, "SKINNY_MIN_WEIGHT", 1)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(16, 2048, generator=g).to(torch.bfloat16).to(DEV)  # 2 tiles, 4 K tiles
    x = torch.randn(1, 2048, generator=g).to(torch.bfloat16).to(DEV)
    enable_cpu_kernels(True)
    try:
        y = G.linear(x, w)
    finally:
        enable_cpu_kernels(False)
    assert calls == [2] and tickets_clear()
    ref = x.float() @ w.float().t()
    ulp = ref.abs().clamp_min(1.0) * 2.0**-7
    assert ((y.float() - ref).abs() <= ulp + 1e-3 * ref.abs().max()).all()
