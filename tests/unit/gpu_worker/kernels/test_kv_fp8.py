"""The FP8 KV cache: the pool's store / read convention, every kernel that writes the pool
(RoPE + store, the one-row qkv GEMV + RoPE + store) storing exactly what ``KVPool.write``
stores, and the decode and extend kernels reading an FP8 pool with its scales against a float64
reference on the dequantized cache. Under CI the kernels run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels import qkv_rope
from gpu_worker.kernels.attention_decode import paged_decode
from gpu_worker.kernels.attention_extend import extend_block_m, extend_blocks, paged_extend
from gpu_worker.kernels.rope import NORM_NONE, rope_store
from gpu_worker.kv_pool import FP8_KV, KVLayerShape, KVPool, kv_dtype
from gpu_worker.models.config import RopeSpec
from gpu_worker.models.layers import rope_inv_freq
from tests.unit.kernel_refs import INPUT_SCALE, fp8_weight, page_table, ref_paged_attention, rel_err

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SCALES = (0.37, 2.5)  # k, v: away from 1.0, so a scale applied twice or not at all shows


def test_pool_halves_bytes_and_keeps_the_store_convention():
    shapes = [KVLayerShape(2, 16), KVLayerShape(1, 32)]
    assert kv_dtype("fp8_e4m3", torch.bfloat16) == FP8_KV and kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert KVPool.bytes_per_token(shapes, FP8_KV) * 2 == KVPool.bytes_per_token(shapes, torch.bfloat16)
    pool = KVPool(shapes, 4, 4, FP8_KV, DEV, scales={1: SCALES})
    assert (pool.k_scale, pool.v_scale) == ([1.0, SCALES[0]], [1.0, SCALES[1]])
    k = torch.randn(3, 1, 32, device=DEV) * 40
    k[0, 0, 0] = 1e4  # past e4m3's range: saturates, never NaN
    v = torch.randn(3, 1, 32, device=DEV)
    loc = torch.tensor([5, 9, 2], device=DEV)
    pool.write(1, loc, k.to(torch.bfloat16), v.to(torch.bfloat16))
    want = _stored(k.to(torch.bfloat16), SCALES[0])
    assert torch.equal(pool.k[1][loc].view(torch.uint8), want)
    rk, rv = pool.read(1, loc, torch.float32)
    assert torch.equal(rk, want.view(FP8_KV).float() * SCALES[0])
    assert rk[0, 0, 0] == torch.tensor(448.0) * SCALES[0]  # saturated
    assert (rv - v).abs().max() < 0.07 * SCALES[1] * max(1.0, v.abs().max().item())


def _fp8_and_bf16_caches(n, hkv, d):
    bf = [torch.zeros(n, hkv, d, dtype=torch.bfloat16, device=DEV) for _ in range(2)]
    f8 = [torch.zeros(n, hkv, d, dtype=FP8_KV, device=DEV) for _ in range(2)]
    return bf, f8


def _stored(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() * (1.0 / scale)).clamp(-448, 448).to(FP8_KV).view(torch.uint8)


def test_rope_store_writes_what_the_pool_stores():
    t, hq, hkv, d = 5, 4, 2, 32
    q = torch.randn(t, hq, d).to(torch.bfloat16).to(DEV)
    k = (torch.randn(t, hkv, d) * 30).to(torch.bfloat16).to(DEV)
    v = torch.randn(t, hkv, d).to(torch.bfloat16).to(DEV)
    pos = torch.arange(7, 7 + t, device=DEV)
    loc = torch.tensor([3, 11, 4, 9, 1], device=DEV)
    inv = rope_inv_freq(d, RopeSpec("default", 10000.0)).to(DEV)
    (kb, vb), (k8, v8) = _fp8_and_bf16_caches(16, hkv, d)
    qb = rope_store(q, k, v, pos, inv, loc, kb, vb, norm=NORM_NONE)
    q8 = rope_store(q, k, v, pos, inv, loc, k8, v8, norm=NORM_NONE, store_scales=(1 / SCALES[0], 1 / SCALES[1]))
    assert torch.equal(qb, q8)  # q never touches the pool
    assert torch.equal(k8.view(torch.uint8), _stored(kb, SCALES[0]))
    assert torch.equal(v8.view(torch.uint8), _stored(vb, SCALES[1]))


def test_qkv_rope_store_writes_what_the_pool_stores():
    hq, hkv, d, kdim = 2, 1, 32, 256
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, kdim, generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.randn((hq + 2 * hkv) * d, kdim, generator=g) * 0.3).to(torch.bfloat16).to(DEV)
    pos, loc = torch.tensor([12], device=DEV), torch.tensor([6], device=DEV)
    inv = rope_inv_freq(d, RopeSpec("default", 10000.0)).to(DEV)
    (kb, vb), (k8, v8) = _fp8_and_bf16_caches(8, hkv, d)
    qb = qkv_rope.qkv_rope_store(x, w, pos, inv, loc, kb, vb, hq, hkv, d)
    q8 = qkv_rope.qkv_rope_store(x, w, pos, inv, loc, k8, v8, hq, hkv, d,
                                 store_scales=(1 / SCALES[0], 1 / SCALES[1]))
    assert torch.equal(qb, q8)
    assert torch.equal(k8.view(torch.uint8), _stored(kb, SCALES[0]))
    assert torch.equal(v8.view(torch.uint8), _stored(vb, SCALES[1]))


def _fp8_pool(n_pages, ps, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    k8 = (torch.randn(n_pages * ps, hkv, d, generator=g) * 3).to(FP8_KV).to(DEV)
    v8 = (torch.randn(n_pages * ps, hkv, d, generator=g) * 3).to(FP8_KV).to(DEV)
    return k8, v8, k8.float().cpu() * SCALES[0], v8.float().cpu() * SCALES[1]


@pytest.mark.parametrize("t,splits,window", [(1, 1, None), (4, 4, None), (1, 2, 5)])
def test_paged_decode_reads_an_fp8_pool(t, splits, window):
    ps, hq, hkv, d = 4, 4, 2, 32
    k8, v8, kref, vref = _fp8_pool(40, ps, hkv, d, seed=t)
    pt = page_table(5, 6, 40, seed=t)
    slots = torch.tensor([3, 1, 4], device=DEV)
    kv_lens = torch.tensor([9, 23, 1 + t], device=DEV)
    q_pos = ((kv_lens - t)[:, None] + torch.arange(t, device=DEV)[None, :]).reshape(-1)
    q = torch.randn(3 * t, hq, d).to(torch.bfloat16).to(DEV)
    out = paged_decode(q, k8, v8, pt, slots, kv_lens, q_pos, t=t, page_size=ps, scale=d**-0.5, window=window,
                       num_splits=splits, kv_scales=SCALES)
    ref = ref_paged_attention(q.cpu(), kref, vref, pt.cpu(), slots.repeat_interleave(t).cpu(),
                              kv_lens.repeat_interleave(t).cpu(), q_pos.cpu(), ps, d**-0.5, window)
    assert rel_err(out, ref) < 2e-2


def test_paged_extend_reads_an_fp8_pool():
    ps, hq, hkv, d = 4, 4, 2, 32
    k8, v8, kref, vref = _fp8_pool(40, ps, hkv, d, seed=11)
    pt = page_table(4, 8, 40, seed=12)
    q_lens = [5, 9]
    slots = torch.tensor([2, 3], device=DEV)
    kv_lens = torch.tensor([12, 20], device=DEV)
    q_pos = torch.cat([torch.arange(7, 12), torch.arange(11, 20)]).to(DEV)
    q = torch.randn(14, hq, d).to(torch.bfloat16).to(DEV)
    bm = extend_block_m([d])
    blocks = torch.from_numpy(extend_blocks(q_lens, bm)).to(DEV)
    out = paged_extend(q, k8, v8, pt, slots, kv_lens, q_pos, blocks, block_m=bm, page_size=ps, scale=d**-0.5,
                       kv_scales=SCALES)
    tok_slot = torch.tensor([2] * 5 + [3] * 9)
    ref = ref_paged_attention(q.cpu(), kref, vref, pt.cpu(), tok_slot, torch.tensor([12] * 5 + [20] * 9),
                              q_pos.cpu(), ps, d**-0.5)
    assert rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("acts,layout", [("none", "channel"), ("dynamic", "channel"), ("dynamic", "block"),
                                         ("static", "channel")])
def test_fp8_qkv_rope_is_the_fp8_gemv_then_rope_store(acts, layout):
    """FP8 qkv weights (and an FP8 pool): bitwise the one-row FP8 GEMV then ``rope_store``."""
    from gpu_worker.kernels import enable_cpu_kernels
    from gpu_worker.kernels.fp8_gemv import fp8_gemv_row
    from gpu_worker.kernels.fp8_linear import A8

    hq, hkv, d, kdim = 2, 1, 32, 384
    w8, s, rows = fp8_weight((hq + 2 * hkv) * d, kdim, layout, seed=5, rows=1)
    x = (torch.randn(1, kdim, generator=torch.Generator().manual_seed(6)) * 3).to(torch.bfloat16).to(DEV)
    fp8 = dict(scale=s, scale_rows=rows, a8=A8[acts], input_scale=INPUT_SCALE.to(DEV) if acts == "static" else None)
    pos, loc = torch.tensor([12], device=DEV), torch.tensor([6], device=DEV)
    inv = rope_inv_freq(d, RopeSpec("default", 10000.0)).to(DEV)
    (_, _), (k8, v8) = _fp8_and_bf16_caches(8, hkv, d)
    k8b, v8b = k8.clone(), v8.clone()
    scales = (1 / SCALES[0], 1 / SCALES[1])
    q = qkv_rope.qkv_rope_store(x, w8, pos, inv, loc, k8, v8, hq, hkv, d, store_scales=scales, **fp8)
    qkv = fp8_gemv_row(x, w8, s, rows, fp8["a8"], fp8["input_scale"])
    qr, kr, vr = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    enable_cpu_kernels(True)
    try:
        assert qkv_rope.applies(x, w8, d)  # the pair it replaces: the one-row FP8 GEMV, one K split
        q_ref = rope_store(qr.view(1, hq, d), kr.view(1, hkv, d), vr.view(1, hkv, d), pos, inv, loc, k8b, v8b,
                           store_scales=scales)
    finally:
        enable_cpu_kernels(False)
    assert torch.equal(q, q_ref)
    assert torch.equal(k8.view(torch.uint8), k8b.view(torch.uint8)) and torch.equal(v8.view(torch.uint8),
                                                                                    v8b.view(torch.uint8))
