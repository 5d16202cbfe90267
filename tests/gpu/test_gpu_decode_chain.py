"""The one-row decode chain on the GPU (kernels/gemv.py, kernels/__init__.py): the gated GEMV and
the split-K GEMV at Llama-8B widths against torch; a chain of them captured in a CUDA graph
gives, on fresh inputs every replay, the bits of the same kernels run eagerly without PDL (a
stale split-K ticket or a read before the wait would show as a moving error); and engines at
8B-like widths give the same greedy tokens with PDL on and off, and the unfused chain's up to
near-ties (split-K sums in another order than cuBLAS)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.kernels import gemv as G
from gpu_worker.kernels import pdl, tickets_clear
from gpu_worker.kernels.activation import gated_act
from gpu_worker.kernels.norm import MODE_ADD_NORM, launch_norm
from tests.helpers.inproc import top_alternatives

H, I = 4096, 14336


@pytest.fixture
def env(monkeypatch):
    """``env(pdl_on, fused)``: PDL for forwards of up to PDL_MAX_TOKENS tokens (as served) or for
    none; the fused projections (gated GEMV, qkv + RoPE, split-K down: as served) or the unfused
    chain (merged GEMV + activation kernel, GEMV + RoPE launch, cuBLAS down)."""
    import gpu_worker.kernels as K
    from gpu_worker.kernels import qkv_rope as QR
    from gpu_worker.models import layers as L
    from gpu_worker.parallel import layers as PL
    from gpu_worker.parallel import linear as PLin

    served = K.PDL_MAX_TOKENS, QR.applies, L.gated_linear, G.linear
    linear_callers = (PL, PLin)  # the modules whose projections call kernels.gemv.linear
    assert all(m.linear is G.linear for m in linear_callers)

    def cublas_long_k(x, w, bias=None):
        return F.linear(x, w, bias) if w.shape[1] > G.SKINNY_MAX_K else served[3](x, w, bias)

    def set_(pdl_on: bool = False, fused: bool = True):
        monkeypatch.setattr(K, "PDL_MAX_TOKENS", served[0] if pdl_on else 0)
        monkeypatch.setattr(QR, "applies", served[1] if fused else (lambda *a: False))
        monkeypatch.setattr(L, "gated_linear", served[2] if fused else (lambda *a: None))
        for m in linear_callers:
            monkeypatch.setattr(m, "linear", served[3] if fused else cublas_long_k)
    return set_


def _mlp_chain(ws, x, r):
    for n1, gu_w, down_w in ws:
        h = launch_norm(MODE_ADD_NORM, x, r, n1, None, None, 1e-5, gemma=False)
        a = G.gated_linear(h, gu_w, "silu")
        assert a is not None
        x = G.linear(a, down_w)
    return x


def test_gated_and_split_k_match_torch_at_llama_width(env):
    env()
    torch.manual_seed(0)
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    a = G.gated_linear(x, gu, "silu")
    ref_gu = F.linear(x, gu)
    torch.testing.assert_close(a.float(), gated_act(ref_gu[:, :I], ref_gu[:, I:], "silu").float(),
                               rtol=2e-2, atol=2e-2)
    # the activation in the tensor-core GEMV's epilogue: bitwise the same GEMV, then the kernel
    # (and past four rows, decode batches up to 64, in the tiles chosen for them)
    for rows in (1, 4, 8, 24, 64):
        xs = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
        plain = G.gemv(xs, gu, **(G.BIG_CONFIG if rows <= 4 else G.wide_gated_config(rows)))
        assert torch.equal(G.gated_linear(xs, gu, "silu"), gated_act(plain[:, :I], plain[:, I:], "silu")), rows
        torch.testing.assert_close(plain.float(), F.linear(xs, gu).float(), rtol=2e-2, atol=2e-2)
    ys = [G.linear(a, down) for _ in range(3)]
    torch.testing.assert_close(ys[0].float(), F.linear(a, down).float(), rtol=2e-2, atol=2e-2)
    assert all(torch.equal(ys[0], y) for y in ys[1:])  # deterministic: split order, not finish order
    assert tickets_clear()


@pytest.mark.parametrize("pdl_on", [False, True])
def test_chain_in_graph_equals_eager(env, pdl_on):
    env(pdl_on)
    if pdl_on and not pdl(torch.empty(1, device="cuda")):
        pytest.skip("PDL needs sm90+ and a Triton with gdc_wait")
    torch.manual_seed(1)
    ws = [(1 + 0.02 * torch.randn(H, device="cuda", dtype=torch.bfloat16),
           0.02 * torch.randn(2 * I, H, device="cuda", dtype=torch.bfloat16),
           0.02 * torch.randn(H, I, device="cuda", dtype=torch.bfloat16)) for _ in range(3)]
    xs = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    rs = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _mlp_chain(ws, xs.clone(), rs.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _mlp_chain(ws, xs, rs)
    for _ in range(8):
        x1 = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
        r1 = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
        xs.copy_(x1)
        rs.copy_(r1)
        graph.replay()
        got, got_r = out.clone(), rs.clone()
        env(False)
        r_ref = r1.clone()
        ref = _mlp_chain(ws, x1.clone(), r_ref)
        env(pdl_on)
        assert torch.equal(got, ref) and torch.equal(got_r, r_ref)


def _llama_8b_width(root, intermediate: int) -> str:
    """Two layers at Llama-8B's hidden size (every projection >= 8M elements takes the GEMV; an
    intermediate size past 8192 gives the down projection split-K)."""
    d = os.path.join(root, f"wide-llama-{intermediate}")
    os.makedirs(d, exist_ok=True)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=H,
               intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
               max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0, torch_dtype="bfloat16",
               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, hidden_act="silu")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


PROMPTS = [list(range(3, 40)), [7] * 20, list(range(100, 300, 3))]


def _run(d, overlap: bool, logprobs: int = 0):
    from tests.helpers.inproc import InProcEngine

    # dummy weights are seeded (the same every time); one running request keeps every decode
    # step at one row, where the GEMVs run
    eng = InProcEngine(d, overlap=overlap, device="cuda", dtype="bfloat16", load_format="dummy",
                       tokenizer_path="models/tiny-shakespeare/target", max_total_tokens=8192,
                       max_running_requests=1, cuda_graph_max_bs=4)
    for i, p in enumerate(PROMPTS):
        eng.submit(f"r{i}", p, max_new_tokens=24, ignore_eos=True, logprobs=logprobs)
    eng.run()
    return eng


@pytest.mark.parametrize("overlap", [True, False])
def test_engine_tokens_equal_with_and_without_pdl(tmp_path, env, overlap):
    d = _llama_8b_width(str(tmp_path), 14336)
    runs = []
    for on in (False, True):
        env(on)
        eng = _run(d, overlap)
        runs.append([eng.tokens[f"r{i}"] for i in range(len(PROMPTS))])
        del eng
        torch.cuda.empty_cache()
    assert runs[0] == runs[1]


def test_engine_tokens_track_unfused(tmp_path, env):
    """With the gated GEMV and split-K down the engine decodes what the unfused chain (GEMV +
    activation kernel + cuBLAS down) decodes, up to a row's first differing token, which must
    be a near-tie in the fused run's own distribution."""
    d = _llama_8b_width(str(tmp_path), 14336)
    engines = []
    for fused in (True, False):
        env(fused=fused)
        engines.append(_run(d, overlap=True, logprobs=2))
    _assert_tracks(*engines)


def _assert_tracks(eng, ref) -> None:
    """Every row of ``eng`` decodes ``ref``'s tokens up to its first differing one, which must
    be a near-tie in ``eng``'s own distribution (both ran with logprobs: its top alternatives)."""
    for i in range(len(PROMPTS)):
        got, want, top = eng.tokens[f"r{i}"], ref.tokens[f"r{i}"], top_alternatives(eng, f"r{i}")
        assert len(got) == len(want) == len(top) == 24
        k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if k is not None:
            assert want[k] in top[k] and abs(top[k][got[k]] - top[k][want[k]]) < 0.05, (i, k, top[k])


def test_qkv_rope_at_llama_width_in_graph():
    """The qkv GEMV with RoPE and the KV store in its epilogue, Llama-8B's heads: bitwise the
    plain GEMV then rope_store, eagerly and in graph replays on fresh rows and positions."""
    from gpu_worker.kernels import qkv_rope as QR
    from gpu_worker.kernels.rope import rope_store
    from gpu_worker.models.config import RopeSpec
    from gpu_worker.models.layers import rope_inv_freq

    torch.manual_seed(5)
    hq, hkv, d, slots = 32, 8, 128, 64
    w = 0.02 * torch.randn((hq + 2 * hkv) * d, H, device="cuda", dtype=torch.bfloat16)
    inv = rope_inv_freq(d, RopeSpec(rope_type="default", theta=500000.0)).cuda()
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    assert QR.applies(x, w, d)
    pos, loc = torch.tensor([0], device="cuda"), torch.tensor([0], device="cuda")
    kc = torch.zeros(slots, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)

    def reference(x1, p, l):
        k2, v2 = kc.clone(), vc.clone()
        q, k, v = G.gemv(x1, w, **G.CONFIG).split([hq * d, hkv * d, hkv * d], dim=-1)
        q = rope_store(q.view(1, hq, d), k.view(1, hkv, d), v.view(1, hkv, d), p, inv, l, k2, v2)
        return q, k2, v2

    QR.qkv_rope_store(x, w, pos, inv, loc, kc, vc, hq, hkv, d)  # warm-up (compile) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out = QR.qkv_rope_store(x, w, pos, inv, loc, kc, vc, hq, hkv, d)
    for i in range(6):
        x1 = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
        p1, l1 = torch.tensor([17 + 997 * i], device="cuda"), torch.tensor([3 + 9 * i], device="cuda")
        q_ref, k_ref, v_ref = reference(x1, p1, l1)
        x.copy_(x1), pos.copy_(p1), loc.copy_(l1)
        graph.replay()
        for name, got, want in (("q", q_out, q_ref), ("k cache", kc, k_ref), ("v cache", vc, v_ref)):
            bad = (got != want).sum().item()
            assert bad == 0, (i, name, bad, (got.float() - want.float()).abs().max().item())


def test_fused_split_merge_in_graph(monkeypatch):
    """Decode attention at one row, Llama-8B's heads, 16 splits merged inside the kernel: graph
    replays on fresh queries give the eager launch's bits, and the merge kernel's result."""
    from gpu_worker.kernels import attention_decode as ad
    from gpu_worker.kernels.attention_decode import paged_decode

    torch.manual_seed(4)
    ps, hkv, hq, d, ctx = 16, 8, 32, 128, 700
    pages = ctx // ps + 2
    kc = torch.randn(pages * ps, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(pages * ps, hkv, d, device="cuda", dtype=torch.bfloat16)
    pt = torch.randperm(pages, device="cuda", dtype=torch.int32)[None, :].repeat(2, 1)
    slots = torch.tensor([1], device="cuda")
    kv_lens = torch.tensor([ctx], device="cuda")
    q_pos = kv_lens - 1
    kw = dict(t=1, page_size=ps, scale=d**-0.5, num_splits=16)
    qs = torch.randn(1, hq, d, device="cuda", dtype=torch.bfloat16)
    paged_decode(qs, kc, vc, pt, slots, kv_lens, q_pos, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode(qs, kc, vc, pt, slots, kv_lens, q_pos, **kw)
    for _ in range(8):
        q1 = torch.randn(1, hq, d, device="cuda", dtype=torch.bfloat16)
        qs.copy_(q1)
        graph.replay()
        got = out.clone()
        assert torch.equal(got, paged_decode(q1, kc, vc, pt, slots, kv_lens, q_pos, **kw))
        with monkeypatch.context() as m:
            m.setattr(ad, "TICKETS", 0)  # the merge kernel
            merged = paged_decode(q1, kc, vc, pt, slots, kv_lens, q_pos, **kw)
        torch.testing.assert_close(got, merged, rtol=1e-2, atol=1e-2)
    assert tickets_clear()


# Lengths per replay i, chosen so the fresh keys fall in a split's first tile (read before the
# wait, then replaced): 16 splits of 64 keys (BLOCK_N 64) at one row; at verify (T = 4, 8 splits
# of 128 keys) the four new keys straddle a split start, two in the tile before the wait, two in
# the loop; 16 rows of one split, every row shorter than one tile.
LENS = {
    (1, 1, 16): lambda i, r: 600 + 5 * i,
    (4, 1, 8): lambda i, r: 128 * (4 + i % 2) + 2,
    (1, 16, 1): lambda i, r: 20 + 2 * r + i,
}


@pytest.mark.parametrize("t,rows,splits", list(LENS))
def test_attention_prologue_after_kv_store_in_graph(env, monkeypatch, t, rows, splits):
    """Decode attention launched with PDL right after the kernel that stores the step's keys
    (rope_store; Llama-8B's heads): it reads its first key tile before that kernel completes
    and the fresh keys after it. Graph replays, each writing new keys at new positions into the
    pool, give the bits of eager launches without PDL (attention output and pool)."""
    from gpu_worker.kernels import PDL_ON
    from gpu_worker.kernels.attention_decode import paged_decode
    from gpu_worker.kernels.rope import rope_store
    from gpu_worker.models.config import RopeSpec
    from gpu_worker.models.layers import rope_inv_freq

    import gpu_worker.kernels as K

    env(True)
    monkeypatch.setattr(K, "PDL_MAX_TOKENS", rows * t)  # 16 rows: past the served 4
    if pdl(torch.empty(rows * t, device="cuda")) != PDL_ON:
        pytest.skip("PDL needs sm90+ and a Triton with gdc_wait")
    torch.manual_seed(6 + t)
    ps, hkv, hq, d, ctx = 16, 8, 32, 128, 800
    lens_of = LENS[(t, rows, splits)]
    pages = rows * (ctx // ps) + 1
    kc = torch.randn(pages * ps, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    pt = (1 + torch.randperm(pages - 1, device="cuda", dtype=torch.int32)).view(rows, -1)
    pt = torch.cat([torch.zeros_like(pt[:1]), pt])  # slot 0: padding
    slots = torch.arange(1, rows + 1, device="cuda")
    inv = rope_inv_freq(d, RopeSpec(rope_type="default", theta=500000.0)).cuda()
    qkv = torch.empty(rows * t, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    kv_lens = torch.empty(rows, dtype=torch.int64, device="cuda")
    q_pos = torch.empty(rows * t, dtype=torch.int64, device="cuda")
    out_loc = torch.empty(rows * t, dtype=torch.int64, device="cuda")

    def step(k_cache, v_cache):
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q = rope_store(q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d), q_pos, inv, out_loc,
                       k_cache, v_cache)
        return paged_decode(q, k_cache, v_cache, pt, slots, kv_lens, q_pos, t=t, page_size=ps, scale=d**-0.5,
                            num_splits=splits)

    def inputs(i):
        qkv.copy_(torch.randn_like(qkv))
        lens = torch.tensor([lens_of(i, r) for r in range(rows)], device="cuda")
        assert int(lens.max()) <= ctx
        kv_lens.copy_(lens)
        pos = (lens - t)[:, None] + torch.arange(t, device="cuda")[None, :]
        q_pos.copy_(pos.reshape(-1))
        page = pt[slots.repeat_interleave(t), (q_pos // ps)].long()
        out_loc.copy_(page * ps + q_pos % ps)

    inputs(0)
    step(kc.clone(), vc.clone())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(kc, vc)
    for i in range(1, 7):
        inputs(i)
        k_ref, v_ref = kc.clone(), vc.clone()
        env(False)
        want = step(k_ref, v_ref)
        env(True)
        monkeypatch.setattr(K, "PDL_MAX_TOKENS", rows * t)
        graph.replay()
        assert torch.equal(out, want), (i, (out.float() - want.float()).abs().max().item())
        assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref)
    assert tickets_clear()


def test_small_projections_track_cublas(tmp_path, monkeypatch):
    """Qwen3-0.6B's widths (o 2M, down 3M, qkv 4M, gate_up 6M elements): at one row every
    projection takes the GEMV (the default smallest weight, 2M elements) and the engine decodes
    what cuBLAS projections decode, up to a row's first differing token, a near-tie."""
    d = os.path.join(str(tmp_path), "qwen3-width")
    os.makedirs(d)
    with open("benchmarks/configs/qwen3-0.6b.json") as f:
        cfg = dict(json.load(f), num_hidden_layers=2, vocab_size=32000)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    x = torch.zeros(1, 2048, device="cuda", dtype=torch.bfloat16)
    assert G.skinny(x, torch.zeros(1024, 2048, device="cuda", dtype=torch.bfloat16))  # o takes the GEMV
    engines = []
    for floor in (G.SKINNY_MIN_WEIGHT, 1 << 40):  # the default, then cuBLAS everywhere
        monkeypatch.setattr(G, "SKINNY_MIN_WEIGHT", floor)
        engines.append(_run(d, overlap=True, logprobs=2))
    _assert_tracks(*engines)
