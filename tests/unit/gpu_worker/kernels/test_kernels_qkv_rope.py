"""The one-row qkv GEMV with RoPE and the KV store in its epilogue (kernels/qkv_rope.py): the bits
of the plain GEMV followed by rope_store, HF's RoPE within the roundings, only the row's slot
written, the dispatch rules, and a Llama layer giving the same output and KV either way."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels import enable_cpu_kernels
from gpu_worker.kernels import gemv as G
from gpu_worker.kernels import qkv_rope as QR
from gpu_worker.kernels.rope import rope_store
from gpu_worker.models.config import RopeSpec
from gpu_worker.models.layers import rope_inv_freq
from tests.unit.kernel_refs import ref_rope

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(hq, hkv, d, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.randn((hq + 2 * hkv) * d, k, generator=g) * k**-0.5).to(torch.bfloat16).to(DEV)
    slots = 9
    kc = torch.randn(slots, hkv, d, generator=g).to(torch.bfloat16).to(DEV)
    vc = torch.randn(slots, hkv, d, generator=g).to(torch.bfloat16).to(DEV)
    return x, w, kc, vc


@pytest.mark.parametrize("hq,hkv,d,k,pos", [(4, 2, 16, 300, 5), (2, 1, 32, 1100, 777), (3, 3, 8, 64, 0)])
def test_equals_gemv_then_rope_store(hq, hkv, d, k, pos):
    """Bitwise the plain GEMV (same tile width, same K tiles) then ``rope_store``; the other
    slots of the caches are untouched."""
    x, w, kc, vc = _inputs(hq, hkv, d, k, seed=hq * 100 + d + k)
    inv = rope_inv_freq(d, RopeSpec(rope_type="default", theta=10000.0)).to(DEV)
    positions = torch.tensor([pos], device=DEV)
    loc = torch.tensor([4], device=DEV)
    kc2, vc2 = kc.clone(), vc.clone()
    q = QR.qkv_rope_store(x, w, positions, inv, loc, kc, vc, hq, hkv, d)

    qkv = G.gemv(x, w, **G.CONFIG)
    qr, kr, vr = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    enable_cpu_kernels(True)
    try:
        q_ref = rope_store(qr.view(1, hq, d), kr.view(1, hkv, d), vr.view(1, hkv, d), positions, inv, loc, kc2, vc2)
    finally:
        enable_cpu_kernels(False)
    assert q.shape == (1, hq, d) and torch.equal(q, q_ref)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    # HF's RoPE on the rounded projection, within the roundings (libm cos / sin; the
    # interpreter truncates to bf16 where compiled code rounds: two ulps)
    hf = ref_rope(qkv[:, : hq * d].view(1, hq, d), positions, inv)
    torch.testing.assert_close(q.float(), hf.float(), rtol=2.0**-6, atol=2.0**-6)
    assert torch.equal(vc[4], vr.view(hkv, d))


def test_applies_only_where_the_plain_pair_runs(monkeypatch):
    monkeypatch.setattr(G, "SKINNY_MIN_WEIGHT", 1)
    x = torch.randn(1, 64).to(torch.bfloat16).to(DEV)
    w = torch.randn(8 * 16, 64).to(torch.bfloat16).to(DEV)
    enable_cpu_kernels(True)
    try:
        assert QR.applies(x, w, 16)
        assert not QR.applies(torch.randn(2, 64).to(torch.bfloat16).to(DEV), w, 16)  # several rows
        assert not QR.applies(x, w, 12)  # half a head is not whole tiles of pairs
        with monkeypatch.context() as m:
            m.setattr(QR, "short_k_splits", lambda *a: 2)
            assert not QR.applies(x, w, 16)  # split K: no single program holds a whole sum
        monkeypatch.setattr(G, "BIG_WEIGHT", 1)
        assert not QR.applies(x, w, 16)  # the tensor-core GEMV's launch
        monkeypatch.setattr(G, "BIG_WEIGHT", 48 << 20)
    finally:
        enable_cpu_kernels(False)
    if DEV == "cpu":
        assert not QR.applies(x, w, 16)  # kernels off: the torch path


def _decode_once(model_dir):
    """Prefill 6 tokens (cuBLAS rows), then one decode row through the triton backend: the
    decode's hidden state and the whole pool."""
    from gpu_worker.models.loader import load_model
    from tests.unit.model_harness import PagedHarness

    model = load_model(model_dir, dtype=torch.bfloat16, device=DEV)
    h = PagedHarness(model.kv_shapes, model.sliding_windows, dtype=torch.bfloat16, device=DEV, backend="triton")
    slot = h.new_slot()
    with torch.inference_mode():
        h.extend(model, [(slot, [5, 9, 2, 7, 11, 3])])
        out = h.extend(model, [(slot, [13])])
    return out, torch.stack([k.clone() for k in h.pool.k]), torch.stack([v.clone() for v in h.pool.v])


def test_llama_decode_row_same_output_and_kv(tmp_path, monkeypatch):
    """A Llama model's one-row decode: the fused kernel runs once a layer, and the hidden state
    and every KV slot equal the GEMV + RoPE launch pair's."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    monkeypatch.setattr(G, "SKINNY_MIN_WEIGHT", 1)
    calls = []
    real = QR.qkv_rope_store
    monkeypatch.setattr(QR, "qkv_rope_store", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    runs = []
    enable_cpu_kernels(True)
    try:
        runs.append(_decode_once(str(tmp_path)))
        monkeypatch.setattr(QR, "applies", lambda *a: False)  # the GEMV, then the RoPE launch
        runs.append(_decode_once(str(tmp_path)))
    finally:
        enable_cpu_kernels(False)
    assert calls == [1, 1]  # the decode row, once per layer; never the prefill rows
    for a, b in zip(*runs):
        assert torch.equal(a, b)
