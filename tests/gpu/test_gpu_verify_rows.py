"""The GEMV at two to four rows on the GPU (kernels/gemv.py, GEMV_MAX_M): MTP's verify
at one request runs T = 4 rows per projection. At Llama-8B and Gemma-4 9B widths each row
matches F.linear, rows are independent of each other and launches repeat bitwise; and a
Gemma-4-shaped MTP engine decodes the same tokens with the verify's projections in the GEMV as
with cuBLAS, up to near-ties (the two sum in different orders)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.kernels import gemv as G
from gpu_worker.kernels import tickets_clear
from tests.helpers.inproc import InProcEngine, top_alternatives

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "benchmarks", "configs")
TOKENIZER = os.path.join(ROOT, "models", "tiny-shakespeare", "target")


@pytest.mark.parametrize("m", [2, 3, 4])
@pytest.mark.parametrize("n,k", [(6144, 4096), (3840, 15360), (30720, 3840)])
def test_several_rows_match_torch(monkeypatch, m, n, k):
    """Each row as F.linear's within bf16 rounding (split-K past SKINNY_MAX_K), a row's bits
    the same whatever the other rows hold, repeat launches bitwise equal, tickets left clear."""
    torch.manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    y = G.linear(x, w)
    torch.testing.assert_close(y.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(y, G.linear(x, w))
    other = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    other[0] = x[0]
    assert torch.equal(G.linear(other, w)[0], y[0])
    assert tickets_clear()


def _gemma_pair(root: str) -> tuple[str, str]:
    """The Gemma-4 9B shape cut to two layers (one sliding, one full) and a 32k vocab, with its
    4-layer assistant: every target projection is wide enough for the GEMV, and split-K down."""
    dirs = []
    for name, layers in (("gemma4-dense-9b", 2), ("gemma4-dense-9b-assistant", None)):
        with open(os.path.join(CONFIGS, f"{name}.json")) as f:
            cfg = json.load(f)
        text = cfg.get("text_config", cfg)
        text["vocab_size"] = 32000
        if layers:
            text["num_hidden_layers"] = layers
            text["layer_types"] = ["sliding_attention", "full_attention"]
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        dirs.append(d)
    return dirs[0], dirs[1]


PROMPTS = [list(range(3, 40)), [7] * 20, list(range(100, 300, 3))]


def _run(target: str, draft: str, overlap: bool) -> InProcEngine:
    # one running request: every verify is T = 4 rows, where the several-row GEMV runs
    eng = InProcEngine(target, draft=draft, steps=3, overlap=overlap, device="cuda", dtype="bfloat16",
                       load_format="dummy", tokenizer_path=TOKENIZER, max_total_tokens=8192,
                       max_running_requests=1, cuda_graph_max_bs=4)
    for i, p in enumerate(PROMPTS):
        eng.submit(f"r{i}", p, max_new_tokens=24, ignore_eos=True, logprobs=2)
    eng.run()
    return eng


@pytest.mark.parametrize("overlap", [True, False])
def test_mtp_engine_tokens_track_cublas_verify(tmp_path, monkeypatch, overlap):
    target, draft = _gemma_pair(str(tmp_path))
    runs = []
    real = G.skinny
    for rows in (G.GEMV_MAX_M, 1):  # the verify's four rows in the GEMV, then in cuBLAS
        monkeypatch.setattr(G, "skinny", lambda x, w: x.shape[0] <= rows and real(x, w))
        runs.append(_run(target, draft, overlap))
        torch.cuda.empty_cache()
    gemv_run, cublas_run = runs
    for i in range(len(PROMPTS)):
        got, want = gemv_run.tokens[f"r{i}"], cublas_run.tokens[f"r{i}"]
        top = top_alternatives(gemv_run, f"r{i}")
        assert len(got) == len(want) == len(top) == 24
        k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if k is not None:  # where they part, both choices are a near-tie in the GEMV run
            assert want[k] in top[k] and abs(top[k][got[k]] - top[k][want[k]]) < 0.05, (i, k, top[k])
