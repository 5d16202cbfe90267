"""The MoE kernels (``gpu_worker/kernels/moe*.py``) against their torch references
(``tests/unit/kernel_refs.py``), under Triton's interpreter on the CPU: routing, the
token-to-expert alignment, the decode path (1-4 tokens) and the grouped path (more), the sum
over slots and Gemma 4's MoE norms. ``tests/gpu/test_gpu_moe_kernels.py`` repeats them at real
shapes on the GPU."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels import interpreting
from gpu_worker.kernels.moe import ExpertScales, fused_experts
from gpu_worker.kernels.moe_align import align_block, max_padded_rows
from gpu_worker.kernels.moe_decode import DECODE_MAX_TOKENS
from gpu_worker.kernels.moe_norm import gemma_moe_combine, gemma_moe_inputs, gemma_moe_tail, moe_sum
from gpu_worker.kernels.moe_route import route_topk
from gpu_worker.quant.fp8_math import dequantize
from tests.unit.kernel_refs import fp8_weight, ref_experts, ref_rms_norm, ref_route

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


@pytest.mark.parametrize("renorm,scaled,rounded", [(True, False, True), (False, False, True), (True, True, False)])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (12, 3), (64, 8)])
def test_route_matches_reference(num_experts, top_k, renorm, scaled, rounded):
    logits = (torch.randn(7, num_experts) * 3).to(torch.bfloat16).to(DEV)
    scale = (torch.rand(num_experts) + 0.5).to(torch.bfloat16).to(DEV) if scaled else None
    ids, w = route_topk(logits, top_k, renorm, scale, round_weights=rounded)
    ref_ids, ref_w = ref_route(logits.cpu(), top_k, renorm, scale.cpu() if scaled else None,
                               torch.bfloat16 if rounded else None)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.cpu(), ref_ids)
    # Triton's interpreter truncates to bf16 where compiled code rounds: one bf16 ulp apart at most
    tol = 2.0**-7 if rounded and interpreting() else 1e-6
    torch.testing.assert_close(w.cpu(), ref_w, rtol=tol, atol=1e-7)


def test_route_picks_the_lowest_index_among_equal_probabilities():
    logits = torch.zeros(2, 8, device=DEV)
    logits[1, 5] = 1.0
    ids, w = route_topk(logits, 3, True)
    assert ids.cpu().tolist() == [[0, 1, 2], [5, 0, 1]]
    torch.testing.assert_close(w.sum(-1).cpu(), torch.ones(2))


@pytest.mark.parametrize("tokens,top_k,num_experts,block_m", [(3, 2, 8, 16), (40, 4, 16, 16), (600, 8, 16, 32)])
def test_align_puts_every_pair_in_its_experts_blocks(tokens, top_k, num_experts, block_m):
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)]).int()
    ids[0] = torch.arange(top_k)  # some experts crowded, some (maybe) unused
    a = align_block(ids.to(DEV), num_experts, block_m)
    n, total = ids.numel(), int(a.n_padded)
    sorted_ids, blocks = a.sorted_ids.cpu(), a.block_expert.cpu()
    counts = torch.bincount(ids.view(-1).long(), minlength=num_experts)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum()) and total % block_m == 0
    assert sorted_ids.numel() == max_padded_rows(n, num_experts, block_m)
    real = sorted_ids[:total]
    assert sorted(real[real < n].tolist()) == list(range(n))  # every pair exactly once
    assert bool((real[real >= n] == n).all())
    used = total // block_m
    assert bool((blocks[used:] == -1).all()) and bool((blocks[:used] >= 0).all())
    assert blocks[:used].tolist() == sorted(blocks[:used].tolist())  # runs in expert order
    for b in range(used):
        rows = real[b * block_m:(b + 1) * block_m]
        rows = rows[rows < n].long()
        assert bool((ids.view(-1)[rows] == blocks[b]).all())


def test_align_places_in_a_second_launch_past_one_program(monkeypatch):
    from gpu_worker.kernels import moe_align

    monkeypatch.setattr(moe_align, "PLACE_IN_COUNT", 8)
    monkeypatch.setattr(moe_align, "CHUNK", 16)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(30)]).int().to(DEV)
    a = moe_align.align_block(ids, 6, 16)
    real = a.sorted_ids.cpu()[: int(a.n_padded)]
    assert sorted(real[real < 60].tolist()) == list(range(60))


def _close_bf16(got, ref):
    """Within a few bf16 ulps of the element or of the row's scale: the slot sum rounds once
    here and per slot in the reference, and the interpreter truncates where compiled code rounds
    (each of the five roundings of a slot)."""
    ref = ref.float()
    ulp = (ref.abs() + ref.pow(2).mean(-1, keepdim=True).sqrt()) * 2.0**-7
    assert bool(((got.float() - ref).abs() <= 4 * ulp).all())


def _experts(num_experts, hidden, inter, dtype):
    gate_up = (torch.randn(num_experts, 2 * inter, hidden) * hidden**-0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter) * inter**-0.5).to(dtype)
    return gate_up, down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2, DECODE_MAX_TOKENS, DECODE_MAX_TOKENS + 1, 37])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_fused_experts_match_reference(tokens, dtype, act):
    num_experts, hidden, inter, top_k = 8, 48, 40, 3  # widths off the tiles: masked edges
    gate_up, down = _experts(num_experts, hidden, inter, dtype)
    x = torch.randn(tokens, hidden).to(dtype)
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)]).int()
    if tokens > 1:
        ids[1] = ids[0]  # two tokens on the same experts: one program serves both in the decode path
    w = torch.rand(tokens, top_k)
    got = fused_experts(x.to(DEV), gate_up.to(DEV), down.to(DEV), ids.to(DEV), w.to(DEV), act).cpu()
    ref = ref_experts(x, gate_up, down, ids, w, act)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    else:
        _close_bf16(got, ref)


def _fp8_experts(num_experts, rows, k, layout, group):
    """e4m3 experts [E, rows, k] and their scales [E, ceil(rows / group), KB], each expert its own."""
    parts = [fp8_weight(rows, k, layout, seed=e, rows=group) for e in range(num_experts)]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def _cast_as_the_kernels(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 -> ``dtype`` as a kernel's cast does: rounded to nearest when compiled; Triton's
    interpreter truncates to bfloat16."""
    if dtype == torch.bfloat16 and interpreting():
        return (t.view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return t.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, DECODE_MAX_TOKENS, 37])
@pytest.mark.parametrize("layout,group", [("channel", 1), ("block", 1), ("block", 128)])
def test_fp8_experts_are_the_experts_dequantized(tokens, dtype, layout, group):
    """FP8 experts through both paths against the same kernels over the experts dequantized at
    load (each tile's float32 value times its scale, rounded to the model dtype): K past one
    128-column scale group and partial tiles on every edge. The grouped path dequantizes its
    tiles so: bit for bit under the interpreter. The decode path multiplies the exact e4m3 values
    and applies the scales to the sums (no rounding of the weights to the model dtype), and a
    GPU's tensor cores may sum a dequantized register tile in another order: within bf16 bounds."""
    num_experts, hidden, inter, top_k = 6, 200, 136, 2
    gate_up, gs = _fp8_experts(num_experts, 2 * inter, hidden, layout, group)
    down, ds = _fp8_experts(num_experts, hidden, inter, layout, group)
    deq = [_cast_as_the_kernels(torch.stack([dequantize(w[e], s[e], group) for e in range(num_experts)]), dtype)
           for w, s in ((gate_up, gs), (down, ds))]
    x = torch.randn(tokens, hidden).to(dtype).to(DEV)
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)]).int().to(DEV)
    w = torch.rand(tokens, top_k).to(DEV)
    got = fused_experts(x, gate_up, down, ids, w, "silu", scales=ExpertScales(gs, ds, group))
    want = fused_experts(x, deq[0], deq[1], ids, w, "silu")
    if interpreting() and tokens > DECODE_MAX_TOKENS:
        assert torch.equal(got, want)
    else:
        _close_bf16(got.float().cpu(), want.float().cpu())


def _decode_shapes() -> list:
    """Every distinct decode launch shape in moe_configs.json, with whether it serves FP8."""
    import json

    from gpu_worker.kernels.moe_configs import PATH

    out = []
    for entry in json.load(open(PATH))["shapes"].values():
        for part in ("decode", "decode_fp8"):
            case = (entry[part], part.endswith("fp8")) if part in entry else None
            if case and case not in out:
                out.append(case)
    return out


@pytest.mark.parametrize("shape,fp8", _decode_shapes())
def test_every_decode_launch_shape_serves_its_experts(shape, fp8, monkeypatch):
    """The launch shapes the file gives real models, on a small problem (K past a 256-column
    tile, partial tiles): within bf16 bounds of the experts dequantized at load."""
    from gpu_worker.kernels import moe

    monkeypatch.setattr(moe, "decode_config", lambda *a, **k: shape[a[4]])
    num_experts, hidden, inter, top_k, tokens = 5, 300, 136, 2, DECODE_MAX_TOKENS
    x = torch.randn(tokens, hidden).to(torch.bfloat16).to(DEV)
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)]).int().to(DEV)
    w = torch.rand(tokens, top_k).to(DEV)
    for layout in ("channel", "block") if fp8 else (None,):
        if fp8:
            gate_up, gs = _fp8_experts(num_experts, 2 * inter, hidden, layout, 1)
            down, ds = _fp8_experts(num_experts, hidden, inter, layout, 1)
            deq = [torch.stack([dequantize(v[e], s[e]) for e in range(num_experts)]).to(torch.bfloat16)
                   for v, s in ((gate_up, gs), (down, ds))]
            scales = ExpertScales(gs.to(DEV), ds.to(DEV), 1)
        else:
            gate_up, down = _experts(num_experts, hidden, inter, torch.bfloat16)
            deq, scales = [gate_up, down], None
        got = fused_experts(x, gate_up.to(DEV), down.to(DEV), ids, w, "silu", scales=scales)
        want = ref_experts(x.cpu(), deq[0], deq[1], ids.cpu(), w.cpu(), "silu")
        _close_bf16(got.float().cpu(), want.float())


def test_moe_sum_adds_each_tokens_slots():
    pairs = torch.randn(5 * 3, 40).to(DEV)
    torch.testing.assert_close(moe_sum(pairs, 3).cpu(), pairs.cpu().view(5, 3, 40).sum(1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_moe_norms_round_as_hf(dtype):
    h, eps = 48, 1e-6
    x, d, m = (torch.randn(3, h).to(dtype) for _ in range(3))
    scale, w1, w2, w3 = ((torch.rand(h) + 0.5).to(dtype) for _ in range(4))
    root = h**-0.5
    r, e = gemma_moe_inputs(x.to(DEV), scale.to(DEV), w3.to(DEV), eps, root)
    out = gemma_moe_combine(d.to(DEV), m.to(DEV), w1.to(DEV), w2.to(DEV), eps)
    want_r = ref_rms_norm(x, None, eps, True) * scale * root  # HF: each product in the model dtype
    want_out = ref_rms_norm(d, w1, eps, True) + ref_rms_norm(m, w2, eps, True)
    for got, want in ((r, want_r), (e, ref_rms_norm(x, w3, eps, True)), (out, want_out)):
        if dtype == torch.float32:
            torch.testing.assert_close(got.cpu(), want, rtol=2e-6, atol=2e-6)
        else:
            _close_bf16(got.cpu(), want.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_moe_tail_is_the_three_kernels_it_replaces(dtype):
    """The slot sum, the combine, and norm.py's residual add + layer scalar + next norm."""
    from gpu_worker.kernels.norm import MODE_NORM_ADD, launch_norm

    t, k, h, eps = 3, 4, 48, 1e-6
    d, x = (torch.randn(t, h).to(dtype).to(DEV) for _ in range(2))
    slots = torch.randn(t * k, h).to(dtype).to(DEV)
    w1, w2, wp, wn = ((torch.rand(h) + 0.5).to(dtype).to(DEV) for _ in range(4))
    scale = torch.tensor([0.8], dtype=dtype, device=DEV)
    x_ref = x.clone()
    h_ref = gemma_moe_combine(d, moe_sum(slots, k), w1, w2, eps)
    want = launch_norm(MODE_NORM_ADD, h_ref, x_ref, wp, wn, scale, eps, gemma=True)
    got = gemma_moe_tail(d, slots, x, w1, w2, wp, wn, scale, eps, k)
    assert torch.equal(x.cpu(), x_ref.cpu()) and torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_sum_add_norm_is_the_sum_then_norm_py_add_norm(dtype):
    from gpu_worker.kernels.moe_norm import moe_sum_add_norm
    from gpu_worker.kernels.norm import MODE_ADD_NORM, launch_norm

    t, k, h, eps = 3, 4, 48, 1e-6
    slots = torch.randn(t * k, h).to(dtype).to(DEV)
    r = torch.randn(t, h).to(dtype).to(DEV)
    w = (torch.rand(h) + 0.5).to(dtype).to(DEV)
    r_ref = r.clone()
    want = launch_norm(MODE_ADD_NORM, moe_sum(slots, k), r_ref, w, None, None, eps, gemma=False)
    got = moe_sum_add_norm(slots, r, w, eps, k)
    assert torch.equal(r.cpu(), r_ref.cpu()) and torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 4])
@pytest.mark.parametrize("renorm,scaled,rounded", [(True, False, True), (True, True, False)])
def test_fused_router_is_the_projection_then_routing(tokens, dtype, renorm, scaled, rounded):
    """router_topk: the logits (x @ W^T in x's dtype), then route_topk; ticket back to 0."""
    from gpu_worker.kernels import tickets_clear
    from gpu_worker.kernels.moe_route import router_topk

    e, h, k = 12, 40, 3
    x = torch.randn(tokens, h).to(dtype).to(DEV)
    w = (torch.randn(e, h) * 0.1).to(dtype).to(DEV)
    scale = (torch.rand(e) + 0.5).to(dtype).to(DEV) if scaled else None
    ids, wt = router_topk(x, w, k, renorm, scale, rounded)
    logits = (x.double() @ w.double().T).to(dtype)
    ref_ids, ref_w = ref_route(logits.cpu(), k, renorm, scale.cpu() if scaled else None, dtype if rounded else None)
    assert tickets_clear()
    # bf16: a logit one ulp apart (the interpreter truncates, the reference rounds) moves the
    # softmax by a few tenths of a percent, the rounded weight by an ulp or two; equal bf16
    # logits may come in another order (the lowest index first here, topk's choice there)
    order, ref_order = ids.cpu().sort(-1), ref_ids.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(wt.cpu().gather(-1, order.indices), ref_w.gather(-1, ref_order.indices), rtol=tol,
                               atol=1e-6)
