"""The MoE kernels at real shapes on the GPU (128 experts, top-8, bf16; Gemma 4 26B-A4B's
H = 2816 / I = 704 and Qwen3-30B-A3B's H = 2048 / I = 768) against torch references: routing,
alignment, the experts on the decode path (1-4 tokens) and the grouped path (5 to 2048 tokens)
-- at least as close to a float64 reference as HF's own bf16 arithmetic -- and every launch
captured in a CUDA graph replaying new routings."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.kernels.moe import ExpertScales, fused_experts
from gpu_worker.kernels.moe_align import align_block
from gpu_worker.kernels.moe_route import route_topk
from gpu_worker.quant.fp8_math import dequantize, expand_scale, quantize_rows
from tests.unit.kernel_refs import ref_route

SHAPES = {"gemma4-26b-a4b": (128, 2816, 704, 8, "gelu_pytorch_tanh"), "qwen3-30b-a3b": (128, 2048, 768, 8, "silu")}
ACT = {"silu": F.silu, "gelu_pytorch_tanh": lambda v: F.gelu(v, approximate="tanh")}


@pytest.fixture(scope="module", params=list(SHAPES))
def model(request):
    e, h, i, k, act = SHAPES[request.param]
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(e, 2 * i, h, device="cuda", generator=g).mul_(h**-0.5).bfloat16()
    down = torch.randn(e, h, i, device="cuda", generator=g).mul_(i**-0.5).bfloat16()
    return gate_up, down, k, act


def _routing(t, e, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(t, e, device="cuda", generator=g)
    ids, w = route_topk(logits, k, True)
    return ids, w


def _reference(x, gate_up, down, ids, w, act, dtype):
    """Expert by expert in ``dtype``: HF's rounding in bf16, or float64 (the truth)."""
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    xs, gu, dn = x.to(dtype), gate_up, down
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        g, u = F.linear(xs[tok], gu[e].to(dtype)).chunk(2, dim=-1)
        y = F.linear((ACT[act](g) * u).to(dtype), dn[e].to(dtype)) * w[tok, slot, None].to(dtype)
        out.index_add_(0, tok, y.to(dtype))
    return out


@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 64, 256, 2048])
def test_experts_at_real_shapes(model, tokens):
    gate_up, down, k, act = model
    e, h = gate_up.shape[0], gate_up.shape[2]
    x = torch.randn(tokens, h, device="cuda").bfloat16()
    ids, w = _routing(tokens, e, k, tokens)
    got = fused_experts(x, gate_up, down, ids, w, act).double()
    truth = _reference(x, gate_up, down, ids, w, act, torch.float64)
    hf = _reference(x, gate_up, down, ids, w, act, torch.bfloat16).double()
    err, hf_err = (got - truth).abs().mean(), (hf - truth).abs().mean()
    assert err <= 1.25 * hf_err + 1e-6, (float(err), float(hf_err))
    assert (got - truth).abs().max() <= 4 * (hf - truth).abs().max() + 1e-3


@pytest.mark.parametrize("rows", [1, 128])
@pytest.mark.parametrize("tokens", [1, 4, 64])
def test_fp8_experts_are_the_experts_dequantized_at_real_shapes(model, tokens, rows):
    """FP8 experts (row scales; 128 x 128 block scales) against the experts dequantized to bf16 at
    load: as close to the float64 truth as HF's bf16 loop and as the bf16 kernels (the tensor
    cores may sum a dequantized register tile in another order than a loaded one)."""
    gate_up, down, k, act = model
    e, h = gate_up.shape[0], gate_up.shape[2]
    q = [[_quantize(w[x], rows) for x in range(e)] for w in (gate_up, down)]
    w8 = [torch.stack([p[0] for p in parts]) for parts in q]
    sc = [torch.stack([p[1] for p in parts]) for parts in q]
    deq = [torch.stack([dequantize(p[0], p[1], rows) for p in parts]).bfloat16() for parts in q]
    x = torch.randn(tokens, h, device="cuda").bfloat16()
    ids, w = _routing(tokens, e, k, tokens)
    got = fused_experts(x, w8[0], w8[1], ids, w, act, scales=ExpertScales(sc[0], sc[1], rows)).double()
    plain = fused_experts(x, deq[0], deq[1], ids, w, act).double()
    truth = _reference(x, deq[0], deq[1], ids, w, act, torch.float64)
    hf = _reference(x, deq[0], deq[1], ids, w, act, torch.bfloat16).double()
    err, ref_err = (got - truth).abs().mean(), max((hf - truth).abs().mean(), (plain - truth).abs().mean())
    assert err <= 1.25 * ref_err + 1e-6, (float(err), float(ref_err))
    assert (got - truth).abs().max() <= 4 * (hf - truth).abs().max() + 1e-3


def _quantize(w: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K] -> e4m3 and scales: one a row (``rows`` 1), or one per 128 x 128 block."""
    if rows == 1:
        return quantize_rows(w)
    r, k = w.shape
    blocks = F.pad(w.float(), (0, -k % 128, 0, -r % 128)).unflatten(0, (-1, 128)).unflatten(2, (-1, 128))
    s = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    return (w.float() / expand_scale(s, rows, r, k)).clamp(-448, 448).to(torch.float8_e4m3fn), s


def test_route_at_real_shape():
    """The kernel picks a top-8 of every row (bf16 logits tie often at 128 experts: which of two
    equal experts is picked is not specified, on CUDA by torch.topk either) and weights each
    picked expert as HF's router does."""
    logits = torch.randn(300, 128, device="cuda").bfloat16()
    scale = (torch.rand(128, device="cuda") + 0.5).bfloat16()
    probs = torch.softmax(logits.cpu().float(), dim=-1)
    for renorm, sc, rounded in ((True, None, True), (False, None, True), (True, scale, False)):
        ids, w = route_topk(logits, 8, renorm, sc, rounded)
        ids, w = ids.cpu().long(), w.cpu()
        _, ref_w = ref_route(logits.cpu(), 8, renorm, sc.cpu() if sc is not None else None,
                             torch.bfloat16 if rounded else None)
        picked = probs.gather(1, ids)
        assert all(len(set(r.tolist())) == 8 for r in ids)  # eight distinct experts a row
        assert torch.equal(picked.sort(dim=1, descending=True).values, probs.topk(8, dim=1).values)
        want = picked / picked.sum(-1, keepdim=True) if renorm else picked
        want = want.to(torch.bfloat16).float() if rounded else want
        want = want * sc.cpu().float()[ids] if sc is not None else want
        # CUDA's and the CPU's exp may differ by an ulp of float32, which can move a weight
        # rounded to bf16 by one bf16 ulp
        tol = dict(rtol=2**-8, atol=0.0) if rounded else dict(rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(w, want, **tol)
        if sc is None:  # tied experts weigh the same: the weights are the reference's, in some order
            torch.testing.assert_close(w.sort(dim=1).values, ref_w.sort(dim=1).values, **tol)


@pytest.mark.parametrize("tokens", [64, 8192])
def test_align_at_real_shape(tokens):
    ids, _ = _routing(tokens, 128, 8, 1)
    for block_m in (16, 64):
        a = align_block(ids, 128, block_m)
        total = int(a.n_padded)
        real = a.sorted_ids[:total]
        real = real[real < ids.numel()]
        assert torch.equal(real.sort().values.cpu(), torch.arange(ids.numel(), dtype=torch.int32))
        counts = torch.bincount(ids.view(-1).long(), minlength=128)
        assert total == int(((counts + block_m - 1) // block_m * block_m).sum())


@pytest.mark.parametrize("tokens", [1, 4, 64])
def test_experts_replay_in_a_cuda_graph(model, tokens):
    """Captured once, replayed with other routings and inputs: the eager result each time (no
    host sync, no buffer sized by the routing)."""
    gate_up, down, k, act = model
    e, h = gate_up.shape[0], gate_up.shape[2]
    x = torch.randn(tokens, h, device="cuda").bfloat16()
    ids, w = _routing(tokens, e, k, 5)
    fused_experts(x, gate_up, down, ids, w, act)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, gate_up, down, ids, w, act)
    for seed in (6, 7):
        new_ids, new_w = _routing(tokens, e, k, seed)
        ids.copy_(new_ids)
        w.copy_(new_w)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, fused_experts(x, gate_up, down, ids, w, act), rtol=0, atol=0)


@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_fused_router_at_real_shape(tokens):
    """router_topk (the projection and the routing in one launch) against cuBLAS's logits then
    the routing kernel: the same experts (a summation-order tie aside) and weights."""
    from gpu_worker.kernels.moe_route import router_topk

    x = torch.randn(tokens, 2816, device="cuda").bfloat16()
    w = (torch.randn(128, 2816, device="cuda") * 2816**-0.5).bfloat16()
    ids, wt = router_topk(x, w, 8, True)
    ref_ids, ref_w = route_topk(F.linear(x, w), 8, True)
    same = (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1)
    assert same.float().mean() >= 0.75
    torch.testing.assert_close(wt.sum(-1), torch.ones(tokens, device="cuda"))
    for r in torch.nonzero(same).flatten().tolist():
        a, b = ids[r].sort(), ref_ids[r].sort()
        torch.testing.assert_close(wt[r][a.indices], ref_w[r][b.indices], rtol=2e-2, atol=1e-4)
