"""The GEMV's environment switches (kernels/gemv.py, kernels/__init__.py): the PDL levels and the
token limit, the pre-wait prefetch budgets (the o projection's included, and which projection
asks for it), and the smallest weight a one-row projection sends through the GEMV."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.kernels import enable_cpu_kernels
from gpu_worker.kernels import gemv as G

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_pdl_switch_and_prefetch_budget(monkeypatch):
    """``TANDEM_PDL`` picks the kernel kinds launched with PDL (the others only let the next
    kernel launch early) for forwards of at most ``TANDEM_PDL_MAX_TOKENS`` tokens; a bad kind
    or token limit is an error naming the variable; CPU tensors never take it. A GEMV's pre-wait
    prefetch is sized by the whole launch (4 MB, ``TANDEM_PDL_PREFETCH_MB``)."""
    from gpu_worker.kernels import PDL_KINDS, PDL_OFF, PDL_ON, PDL_TRIGGER, pdl, pdl_kinds

    assert pdl_kinds("0") == frozenset() and pdl_kinds("1") == frozenset(PDL_KINDS)
    assert pdl_kinds("gemv+attn") == pdl_kinds("attn,gemv") == {"gemv", "attn"}
    with pytest.raises(ValueError, match="TANDEM_PDL"):
        pdl_kinds("gemv,bogus")
    monkeypatch.setenv("TANDEM_PDL", "1")
    assert pdl(torch.zeros(1), "gemv") == PDL_OFF  # a CPU tensor
    # the levels on a (stand-in) sm90 CUDA tensor of n tokens
    import types

    import gpu_worker.kernels as K

    monkeypatch.setattr(K, "_pdl_device", lambda index: True)

    def rows(n):
        return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), shape=(n, 4096))

    assert pdl(rows(4), "gemv") == PDL_ON and pdl(rows(5), "gemv") == PDL_OFF  # default limit: 4 tokens
    monkeypatch.setenv("TANDEM_PDL", "gemv")
    assert pdl(rows(1), "gemv") == PDL_ON and pdl(rows(1), "attn") == PDL_TRIGGER
    monkeypatch.setenv("TANDEM_PDL_MAX_TOKENS", "16")
    assert pdl(rows(16), "gemv") == PDL_ON
    monkeypatch.setenv("TANDEM_PDL", "0")
    assert pdl(rows(1), "gemv") == PDL_OFF
    monkeypatch.setenv("TANDEM_PDL_MAX_TOKENS", "x")
    with pytest.raises(ValueError, match="TANDEM_PDL_MAX_TOKENS"):
        pdl(torch.zeros(1, device="meta"), "gemv")
    monkeypatch.delenv("TANDEM_PDL_PREFETCH_MB", raising=False)
    assert G.prefetch_cols(4096, 1, 4096) == 512  # 4 MB by default
    assert G.prefetch_cols(28672, 1, 4096) == 64  # gate_up: its programs share the same 4 MB
    monkeypatch.setenv("TANDEM_PDL_PREFETCH_MB", "0")
    assert G.prefetch_cols(4096, 1, 4096) == 0
    monkeypatch.setenv("TANDEM_PDL_PREFETCH_MB", "16")
    assert G.prefetch_cols(4096, 1, 4096) == 2048  # o: 16 MB = half its 4096 x 4096 bf16
    assert G.prefetch_cols(4096, 4, 3584) == 512  # a split-K down: four K chunks share the budget
    assert G.prefetch_cols(28672, 1, 4096) == 256
    assert G.prefetch_cols(1 << 20, 1, 4096) == 0
    # the o projection (after attention) takes the same budget unless its own variable is set
    assert G.prefetch_mb() == G.prefetch_mb(after_attention=True) == 16.0
    monkeypatch.delenv("TANDEM_PDL_PREFETCH_MB")
    assert G.prefetch_mb() == 4.0 and G.prefetch_mb(after_attention=True) == 4.0
    monkeypatch.setenv("TANDEM_PDL_PREFETCH_MB_O", "32")
    assert G.prefetch_mb(after_attention=True) == 32.0 and G.prefetch_mb() == 4.0
    assert G.prefetch_cols(4096, 1, 4096, G.prefetch_mb(after_attention=True)) == 4096  # the whole o weight
    for bad in ("-1", "lots"):
        monkeypatch.setenv("TANDEM_PDL_PREFETCH_MB_O", bad)
        with pytest.raises(ValueError, match="TANDEM_PDL_PREFETCH_MB_O"):
            G.prefetch_mb(after_attention=True)


def test_llama_o_projection_takes_the_after_attention_budget(tmp_path, monkeypatch):
    """Llama's o projection, and no other, asks the GEMV for the after-attention prefetch budget."""
    transformers = pytest.importorskip("transformers")
    from gpu_worker.models.loader import load_model

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    model = load_model(str(tmp_path), dtype=torch.bfloat16, device=DEV)
    layer = model.model.layers[0]
    seen = []
    monkeypatch.setattr(G, "SKINNY_MIN_WEIGHT", 1)
    monkeypatch.setattr(G, "gemv", lambda x, w, **kw: seen.append(kw["after_attention"]) or F.linear(x, w))
    enable_cpu_kernels(True)
    try:
        layer.self_attn.o_proj(torch.randn(1, 64).to(torch.bfloat16).to(DEV))
        layer.mlp.down_proj(torch.randn(1, 96).to(torch.bfloat16).to(DEV))
        layer.self_attn.qkv_proj(torch.randn(1, 64).to(torch.bfloat16).to(DEV))
    finally:
        enable_cpu_kernels(False)
    assert seen == [True, False, False]


def test_min_weight_from_the_environment():
    """``TANDEM_GEMV_MIN_WEIGHT`` (elements, read at import) moves the smallest weight a one-row
    projection sends through the GEMV; a bad value is an error naming the variable."""
    import os
    import subprocess
    import sys

    code = "from gpu_worker.kernels import gemv as G; print(G.SKINNY_MIN_WEIGHT)"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_GEMV_MIN_WEIGHT"}

    def run(extra: dict) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], cwd=root, env={**env, **extra}, capture_output=True,
                              text=True, timeout=120)

    assert run({}).stdout.strip() == str(2 << 20)
    assert run({"TANDEM_GEMV_MIN_WEIGHT": "4194304"}).stdout.strip() == "4194304"
    bad = run({"TANDEM_GEMV_MIN_WEIGHT": "4M"})
    assert bad.returncode != 0 and "TANDEM_GEMV_MIN_WEIGHT" in bad.stderr
