"""Programmatic dependent launch and the fused act+down GEMV on the GPU (kernels/__init__.py,
kernels/gemv.py): a kernel chain captured with PDL gives the bits of the same kernels run
eagerly without it, on fresh inputs every replay (a read before the wait would show as a
moving error), and an engine at 8B-like widths, where every projection takes the GEMV, gives
the same greedy tokens with PDL on and off."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.kernels import gemv as G
from gpu_worker.kernels import pdl
from gpu_worker.kernels.activation import gated_act
from gpu_worker.kernels.norm import MODE_ADD_NORM, launch_norm

H, I = 4096, 14336


@pytest.fixture
def pdl_env(monkeypatch):
    def set_(on: bool, fused: bool = True):
        monkeypatch.setenv("TANDEM_PDL", "1" if on else "0")
        monkeypatch.setenv("TANDEM_FUSED_DOWN", "1" if fused else "0")
    return set_


def _chain(ws, x, r):
    for n1, gu_w, down_w in ws:
        h = launch_norm(MODE_ADD_NORM, x, r, n1, None, None, 1e-5, gemma=False)
        gu = G.gemv(h, gu_w, **G.CONFIG)
        x = G.gemv(gu, down_w, act="silu", **G.CONFIG)
    return x


def test_fused_down_matches_torch_at_llama_width():
    torch.manual_seed(0)
    gu = torch.randn(1, 2 * I, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    y = G.gemv(gu, w, act="silu", **G.CONFIG)
    ref = F.linear(gated_act(gu[:, :I], gu[:, I:], "silu"), w)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_pdl_chain_in_graph_equals_eager(pdl_env):
    pdl_env(True)
    if not pdl(torch.empty(1, device="cuda")):
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
        _chain(ws, xs.clone(), rs.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(ws, xs, rs)
    for _ in range(8):
        x1 = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
        r1 = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
        xs.copy_(x1)
        rs.copy_(r1)
        graph.replay()
        got, got_r = out.clone(), rs.clone()
        pdl_env(False)
        r_ref = r1.clone()
        ref = _chain(ws, x1.clone(), r_ref)
        pdl_env(True)
        assert torch.equal(got, ref) and torch.equal(got_r, r_ref)


def _llama_8b_width(root) -> str:
    """Two layers at Llama-8B's hidden size (every projection >= 8M elements takes the GEMV)."""
    d = os.path.join(root, "wide-llama")
    os.makedirs(d, exist_ok=True)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=H,
               intermediate_size=4096, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
               max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0, torch_dtype="bfloat16",
               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, hidden_act="silu")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


@pytest.mark.parametrize("overlap", [True, False])
def test_engine_tokens_equal_with_and_without_pdl(tmp_path, pdl_env, overlap):
    from tests.helpers.inproc import InProcEngine

    d = _llama_8b_width(str(tmp_path))
    prompts = [list(range(3, 40)), [7] * 20, list(range(100, 300, 3))]
    runs = []
    for on in (False, True):
        pdl_env(on)
        # dummy weights are seeded (the same both times); one running request keeps every decode
        # step at one row, where the GEMV and the fused down run
        eng = InProcEngine(d, overlap=overlap, device="cuda", dtype="bfloat16", load_format="dummy",
                           tokenizer_path="models/tiny-shakespeare/target", max_total_tokens=8192,
                           max_running_requests=1, cuda_graph_max_bs=4)
        for i, p in enumerate(prompts):
            eng.submit(f"r{i}", p, max_new_tokens=24, ignore_eos=True)
        eng.run()
        runs.append([eng.tokens[f"r{i}"] for i in range(len(prompts))])
        del eng
        torch.cuda.empty_cache()
    assert runs[0] == runs[1]
