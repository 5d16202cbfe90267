"""Paged decode / verify / draft and extend attention kernels against a float64 reference.

Under CI (no CUDA) they run in Triton's interpreter; on the GPU machine, compiled. Fresh random
data per case; outputs are poisoned first so an unwritten element fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.kernels.attention_decode import paged_decode
from gpu_worker.kernels.attention_extend import extend_block_m, extend_blocks, paged_extend
from tests.unit.kernel_refs import page_table, ref_paged_attention, rel_err

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _pool(n_pages, ps, hkv, d, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(n_pages * ps, hkv, d, generator=g).to(dtype)
    vc = torch.randn(n_pages * ps, hkv, dv, generator=g).to(dtype)
    return kc.to(DEV), vc.to(DEV)


@pytest.mark.parametrize(
    "dtype,hq,hkv,d,dv,t,window,softcap,splits",
    [
        (torch.float32, 4, 2, 32, 32, 1, None, None, 1),
        (torch.float32, 4, 1, 32, 32, 3, None, None, 4),  # verify rows, split-KV
        (torch.float32, 2, 2, 48, 48, 1, 5, None, 2),  # non-power-of-2 head dim, sliding window
        (torch.float32, 8, 2, 16, 16, 4, 3, 20.0, 1),  # window shorter than the verify run, softcap
        (torch.bfloat16, 4, 2, 32, 32, 2, None, None, 4),
        (torch.bfloat16, 4, 4, 64, 64, 1, 7, None, 1),
    ],
)
def test_paged_decode(dtype, hq, hkv, d, dv, t, window, softcap, splits):
    ps, n_pages, max_pages = 4, 40, 6
    kc, vc = _pool(n_pages, ps, hkv, d, dv, dtype, seed=d + t)
    pt = page_table(5, max_pages, n_pages, seed=t)
    slots = torch.tensor([3, 1, 0, 4], device=DEV)  # slot 0: a graph padding row with no keys
    kv_lens = torch.tensor([9, 23, 0, 1 + t], device=DEV)
    start = (kv_lens - t).clamp_min(0)
    q_pos = (start[:, None] + torch.arange(t, device=DEV)[None, :]).reshape(-1)
    q_pos[2 * t : 3 * t] = 0
    q = torch.randn(4 * t, hq, d).to(dtype).to(DEV)
    out = torch.full((4 * t, hq, dv), float("nan"), dtype=dtype, device=DEV)
    paged_decode(q, kc, vc, pt, slots, kv_lens, q_pos, t=t, page_size=ps, scale=d**-0.5, window=window,
                 softcap=softcap, num_splits=splits, out=out)
    tok_slot = slots.repeat_interleave(t).cpu()
    ref = ref_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), pt.cpu(), tok_slot, kv_lens.repeat_interleave(t).cpu(),
                              q_pos.cpu(), ps, d**-0.5, window, softcap)
    assert not torch.isnan(out).any()
    assert torch.equal(out[2 * t : 3 * t].cpu(), torch.zeros_like(out[2 * t : 3 * t]).cpu())
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("t,splits", [(1, 1), (3, 2)])
def test_paged_decode_launch_order_changes_no_bit(t, splits):
    """Rows served in a given launch order (longest first in the engine) give the bits of the
    default order: only which program serves which row moves."""
    ps, hkv, hq, d = 4, 2, 4, 32
    kc, vc = _pool(40, ps, hkv, d, d, torch.bfloat16, seed=5)
    pt = page_table(6, 8, 40, seed=6)
    slots = torch.tensor([3, 1, 0, 4, 5], device=DEV)
    kv_lens = torch.tensor([9, 23, 0, 1 + t, 30], device=DEV)
    q_pos = ((kv_lens - t).clamp_min(0)[:, None] + torch.arange(t, device=DEV)[None, :]).reshape(-1)
    q = torch.randn(5 * t, hq, d).to(torch.bfloat16).to(DEV)
    kw = dict(t=t, page_size=ps, scale=d**-0.5, num_splits=splits)
    plain = paged_decode(q, kc, vc, pt, slots, kv_lens, q_pos, **kw)
    order = torch.argsort(kv_lens, descending=True)
    assert order.tolist()[:2] == [4, 1]
    ordered = paged_decode(q, kc, vc, pt, slots, kv_lens, q_pos, order=order, **kw)
    assert torch.equal(plain, ordered)


def _five_rows(t, hq, d, longest):
    """Slots, lengths, query positions and queries of five rows, t queries each: row 2 is a graph
    padding row (slot 0, no keys), row 3 holds only this forward's keys."""
    slots = torch.tensor([3, 1, 0, 4, 5], device=DEV)
    kv_lens = torch.tensor([9, longest, 0, 1 + t, 30], device=DEV)
    q_pos = ((kv_lens - t).clamp_min(0)[:, None] + torch.arange(t, device=DEV)[None, :]).reshape(-1)
    q_pos[2 * t : 3 * t] = 0
    q = torch.randn(5 * t, hq, d, generator=torch.Generator().manual_seed(t)).to(DEV)
    return slots, kv_lens, q_pos, q


@pytest.mark.parametrize("t,splits,window", [(1, 4, None), (3, 2, None), (1, 8, 5)])
def test_split_merge_in_the_decode_kernel(monkeypatch, t, splits, window):
    """Split-KV partials merged by the last split of each (row, KV head) inside the decode kernel
    give the merge kernel's result (the same arithmetic, summed in split order), the same bits
    on every launch, zeros for a row with no keys, and leave every ticket at 0."""
    from gpu_worker.kernels import attention_decode as ad
    from gpu_worker.kernels import tickets_clear

    ps, hkv, hq, d = 4, 2, 4, 32
    kc, vc = _pool(40, ps, hkv, d, d, torch.float32, seed=9 + t)
    pt = page_table(6, 8, 40, seed=10)
    slots, kv_lens, q_pos, q = _five_rows(t, hq, d, longest=23)
    kw = dict(t=t, page_size=ps, scale=d**-0.5, num_splits=splits, window=window)
    monkeypatch.setattr(ad, "TICKETS", 0)  # more (row, KV head) pairs than tickets: the merge kernel
    two_kernels = paged_decode(q, kc, vc, pt, slots, kv_lens, q_pos, **kw)
    monkeypatch.undo()
    fused = [paged_decode(q, kc, vc, pt, slots, kv_lens, q_pos, **kw) for _ in range(2)]
    assert tickets_clear()
    assert torch.equal(fused[0], fused[1])
    assert torch.equal(fused[0][2 * t : 3 * t], torch.zeros_like(fused[0][2 * t : 3 * t]))
    torch.testing.assert_close(fused[0], two_kernels, rtol=1e-5, atol=1e-6)
    ref = ref_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), pt.cpu(), slots.repeat_interleave(t).cpu(),
                              kv_lens.repeat_interleave(t).cpu(), q_pos.cpu(), ps, d**-0.5, window)
    assert rel_err(fused[0], ref) < 2e-5


def test_paged_decode_draft_read_sees_exactly_committed_keys():
    """The frozen-KV draft: q_pos = kv_len - 1, so each row sees [0, kv_len), on sliding layers
    the last `window` of them, whatever its RoPE position."""
    ps, hkv, d = 4, 2, 32
    kc, vc = _pool(30, ps, hkv, d, d, torch.float32, seed=3)
    pt = page_table(3, 6, 30, seed=4)
    slots = torch.tensor([1, 2], device=DEV)
    kv_lens = torch.tensor([11, 6], device=DEV)
    q = torch.randn(2, 4, d, device=DEV)
    for window in (None, 4):
        out = paged_decode(q, kc, vc, pt, slots, kv_lens, kv_lens - 1, t=1, page_size=ps, scale=0.2,
                           window=window, num_splits=2)
        ref = ref_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), pt.cpu(), slots.cpu(), kv_lens.cpu(),
                                  (kv_lens - 1).cpu(), ps, 0.2, window)
        assert rel_err(out, ref) < 2e-5


@pytest.mark.parametrize(
    "dtype,hq,hkv,d,window,softcap",
    [
        (torch.float32, 4, 2, 32, None, None),
        (torch.float32, 2, 1, 48, 6, None),
        (torch.float32, 4, 4, 16, None, 15.0),
        (torch.bfloat16, 4, 2, 32, 9, None),
    ],
)
def test_paged_extend(dtype, hq, hkv, d, window, softcap):
    """Chunks over a cached prefix: row 0 starts at 0, row 1 continues after 13 cached tokens,
    row 2 is a one-token chunk; plus a 70-token row spanning two query blocks."""
    ps, n_pages, max_pages = 4, 64, 24
    kc, vc = _pool(n_pages, ps, hkv, d, d, dtype, seed=d)
    pt = page_table(5, max_pages, n_pages, seed=d)
    starts = np.array([0, 13, 5, 2])
    lens = np.array([7, 9, 1, 70])
    slots = torch.tensor([2, 4, 1, 3], device=DEV)
    q_pos = torch.from_numpy(np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])).to(DEV)
    kv_lens = torch.from_numpy(starts + lens).to(DEV)
    n = int(lens.sum())
    q = torch.randn(n, hq, d).to(dtype).to(DEV)
    bm = extend_block_m([d])
    blocks = torch.from_numpy(extend_blocks(lens, bm)).to(DEV)
    out = torch.full((n, hq, d), float("nan"), dtype=dtype, device=DEV)
    paged_extend(q, kc, vc, pt, slots, kv_lens, q_pos, blocks, block_m=bm, page_size=ps, scale=d**-0.5,
                 window=window, softcap=softcap, out=out)
    tok_slot = torch.from_numpy(np.repeat(slots.cpu().numpy(), lens))
    tok_kv = torch.from_numpy(np.repeat(starts + lens, lens))
    ref = ref_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), pt.cpu(), tok_slot, tok_kv, q_pos.cpu(), ps,
                              d**-0.5, window, softcap)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < TOL[dtype]


def test_extend_blocks_cover_every_token_once():
    lens = np.array([0, 5, 64, 65, 1])
    b = extend_blocks(lens, 32)
    covered = np.concatenate([np.arange(s, s + c) for s, c in zip(b[1], b[2])])
    assert np.array_equal(np.sort(covered), np.arange(lens.sum()))
    assert (b[2] > 0).all() and (b[2] <= 32).all()
    assert list(b[0]) == [1, 2, 2, 3, 3, 3, 4]


def test_decode_launch_shape_override(monkeypatch):
    """``tune`` (benchmark sweeps) overrides the decode kernel's launch shape: same values as the
    default shape within rounding."""
    from gpu_worker.kernels import attention_decode as ad

    ps, hkv, hq, d = 4, 2, 4, 32
    kc, vc = _pool(40, ps, hkv, d, d, torch.float32, seed=8)
    pt = page_table(6, 8, 40, seed=9)
    slots = torch.tensor([3, 1, 4], device=DEV)
    kv_lens = torch.tensor([9, 23, 30], device=DEV)
    q = torch.randn(3, hq, d).to(DEV)
    kw = dict(t=1, page_size=ps, scale=d**-0.5)
    plain = paged_decode(q, kc, vc, pt, slots, kv_lens, kv_lens - 1, **kw)
    seen = []
    real = ad._decode_kernel.__getitem__
    monkeypatch.setattr(type(ad._decode_kernel), "__getitem__",
                        lambda self, grid: (lambda *a, **k: seen.append(k["BLOCK_N"]) or real(grid)(*a, **k)))
    tuned = paged_decode(q, kc, vc, pt, slots, kv_lens, kv_lens - 1, tune={"block_n": 16, "num_stages": 2}, **kw)
    assert seen == [16]
    assert rel_err(tuned, plain.double().cpu()) < TOL[torch.float32]


@pytest.mark.parametrize("t,splits,window", [(3, 1, None), (1, 4, None), (3, 2, 5)])
def test_pdl_prologue_reads_no_fresh_key_and_changes_no_bit(monkeypatch, t, splits, window):
    """Launched with PDL, the decode kernel reads its split's first key tile before waiting for
    the previous kernel, and the keys at the rows' query positions (which that kernel may still
    be writing) after it. Row 0 is short enough to lie in the first tile of split 0, which the
    first program serves (the interpreter runs programs in grid order); its fresh keys hold NaN
    until that program's wait (a hook in place of ``gdc_enter`` stores them): one taken from
    before the wait would leave NaN. The longer rows run the peeled tile and the loop; the
    result is the bits of the launch without PDL."""
    from gpu_worker.kernels import PDL_ON
    from gpu_worker.kernels import attention_decode as ad

    if DEV != "cpu":
        pytest.skip("the hook runs in the interpreter (the GPU twin: tests/gpu/test_gpu_decode_chain.py)")
    ps, hkv, hq, d = 4, 2, 4, 32
    kc, vc = _pool(40, ps, hkv, d, d, torch.bfloat16, seed=11 + t)
    pt = page_table(6, 12, 40, seed=12)
    slots = torch.tensor([3, 1, 0, 4, 5])
    block_n = 8
    kv_lens = torch.tensor([6, 40, 0, 1 + t, 30])
    assert kv_lens[0] <= block_n  # row 0: one tile, the first of split 0, whatever the split count
    q_pos = ((kv_lens - t).clamp_min(0)[:, None] + torch.arange(t)[None, :]).reshape(-1)
    q_pos[2 * t : 3 * t] = 0
    q = torch.randn(5 * t, hq, d, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
    kw = dict(t=t, page_size=ps, scale=d**-0.5, num_splits=splits, window=window, tune={"block_n": block_n})
    want = paged_decode(q, kc, vc, pt, slots, kv_lens, q_pos, **kw)

    fresh = [int(pt[3, p // ps]) * ps + p % ps for p in q_pos[:t].tolist()]  # row 0's new keys
    real_k, real_v = kc[fresh].clone(), vc[fresh].clone()
    kc[fresh], vc[fresh] = float("nan"), float("nan")
    waits = []

    def store_at_wait(level):  # the previous kernel completes: its stores become visible
        waits.append(level)
        kc[fresh], vc[fresh] = real_k, real_v

    monkeypatch.setattr(ad, "pdl", lambda x: PDL_ON)
    monkeypatch.setattr(ad, "gdc_enter", store_at_wait)
    got = paged_decode(q, kc, vc, pt, slots, kv_lens, q_pos, **kw)
    assert waits and not torch.isnan(got).any()
    assert torch.equal(got, want)


@pytest.mark.parametrize("t,window", [(1, None), (4, None), (1, 5), (2, None)])
def test_splits_without_keys_are_skipped_by_both_merges(monkeypatch, t, window):
    """Eight pieces of short rows: the pieces past a row's keys store an empty partial at once,
    and both merges (in the decode kernel, and the merge kernel when tickets run out) skip the
    partials no key was seen for (their buffers are poisoned with NaN here, as fresh GPU memory
    may be); the result matches the reference."""
    from gpu_worker.kernels import attention_decode as ad
    from gpu_worker.kernels import tickets_clear

    ps, hkv, hq, d, splits = 4, 2, 4, 32, 8
    # compiled (CUDA), tl.dot needs tiles of 16 keys: every length x 4
    x = 4 if DEV == "cuda" else 1
    kc, vc = _pool(40 * x, ps, hkv, d, d, torch.float32, seed=13 + t)
    pt = page_table(6, 10 * x, 40 * x, seed=14)
    slots, kv_lens, q_pos, q = _five_rows(t, hq, d, longest=37 * x)
    kw = dict(t=t, page_size=ps, scale=d**-0.5, num_splits=splits, window=window, tune={"block_n": 4 * x})
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (lambda x: x.fill_(float("nan")) if x.is_floating_point()
                                                         else x)(real_empty(*a, **k)))
    fused = paged_decode(q, kc, vc, pt, slots, kv_lens, q_pos, **kw)
    monkeypatch.setattr(ad, "TICKETS", 0)
    separate = paged_decode(q, kc, vc, pt, slots, kv_lens, q_pos, **kw)
    assert not torch.isnan(fused).any() and not torch.isnan(separate).any() and tickets_clear()
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-6)
    ref = ref_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), pt.cpu(), slots.repeat_interleave(t).cpu(),
                              kv_lens.repeat_interleave(t).cpu(), q_pos.cpu(), ps, d**-0.5, window)
    assert rel_err(fused, ref) < 2e-5
