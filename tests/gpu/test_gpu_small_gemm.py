"""The small-M decode GEMM (kernels/gemm.py) on the GPU: at Qwen3-0.6B's and Llama-8B's
projection shapes and decode-batch row counts it stays within a bf16 rounding of the fp32
product, a CUDA-graph replay gives the eager bits, and an engine whose every linear layer goes
through it (widened to float32 rows) still gives HF's greedy tokens, with and without MTP."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels import gemm, gemv
from tests.gpu.test_gpu_parity import PROMPTS, ckpts, hf_greedy_cuda  # noqa: F401 - ckpts is a fixture
from tests.helpers.inproc import InProcEngine

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (4096, 4096)]


@pytest.mark.parametrize("m", [16, 64, 144, 256])
@pytest.mark.parametrize("n,k", SHAPES)
def test_small_gemm_close_to_fp32_and_graph_bitwise(m, n, k):
    torch.manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    y = gemm.small_gemm(x, w)
    ref = x.float() @ w.float().t()
    ulp = ref.abs().clamp_min(1.0) * 2.0**-8  # half a bf16 ulp of rounding, plus fp32 reordering
    assert ((y.float() - ref).abs() <= ulp + 1e-4 * ref.abs().max()).all()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm.small_gemm(x, w)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y)


@pytest.mark.parametrize("arch,mtp", [("qwen3", False), ("llama", False), ("gemma4", True)])
def test_engine_through_small_gemm_matches_hf(ckpts, arch, mtp, monkeypatch):  # noqa: F811
    monkeypatch.setattr(gemv, "SMALL_GEMM_M", (2, 256))
    monkeypatch.setattr(gemv, "SMALL_GEMM_DTYPES", (torch.float32,))
    calls = []
    real = gemm.small_gemm
    monkeypatch.setattr(gemv, "small_gemm", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    d = ckpts[arch]
    prompts = PROMPTS * 8
    eng = InProcEngine(d, draft=ckpts["assistant"] if mtp else None, steps=3, device="cuda", dtype="float32",
                       chunked_prefill_size=64, max_total_tokens=65536)
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, max_new_tokens=24, ignore_eos=True)
    eng.run()
    assert calls and max(calls) >= 16
    for i, p in enumerate(prompts):
        assert eng.tokens[f"r{i}"] == hf_greedy_cuda(d, p, 24), (arch, i)
