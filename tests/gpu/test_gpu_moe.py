"""Mixture-of-experts targets on CUDA, CUDA graphs on (decode, verify and draft graphs, piecewise
prefill graphs): greedy tokens equal HF transformers (float32 on the GPU) for Gemma 4 with its
MoE block and for Qwen3-MoE, with overlap on and off, and for the Gemma 4 MoE target with a
frozen-KV assistant (MTP == plain == HF); in bf16, the graphs give the eager path's tokens. FP8
experts (e4m3 in memory, dequantized in the kernels' registers): weight-only FP8 checkpoints in
both expert layouts equal HF on the dequantized checkpoint, MTP on an online-FP8 MoE target with
the FP8 KV cache equals the same engine without MTP, and bf16 graphs give the eager tokens."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.helpers.checkpoints import build_assistant, build_gemma4_moe, build_qwen3_moe, rewrite_experts
from tests.helpers.fp8_checkpoints import dequantized, quantize_checkpoint
from tests.helpers.inproc import InProcEngine
from tests.helpers.oracle_draft import BigramDraft, bigram_table

# A lone request, several of unequal lengths (graph buckets with padding rows), some longer
# than the chunk: the experts' decode path (1-4 tokens) and grouped path (more) both run.
PROMPTS = [[5, 17, 33, 99, 120, 7, 8, 9, 10, 11] * 3, [4, 5, 6], list(range(10, 60)), [200] * 40, [7, 8]]
NEW = 24


@functools.lru_cache(maxsize=4)
def _hf_cuda(model_dir):
    """HF's model in float32 on the GPU, its experts as its eager loop (exact float32 products;
    HF's default grouped kernels may round through another precision on the GPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager")
    model = model.cuda().eval()
    model.generation_config.eos_token_id = None
    return model


@functools.lru_cache(maxsize=512)
def _hf_greedy(model_dir, prompt, n):
    ids = torch.tensor([list(prompt)], device="cuda")
    with torch.no_grad():
        out = _hf_cuda(model_dir).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                           do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def hf_greedy_cuda(model_dir, prompt, n):
    return _hf_greedy(model_dir, tuple(prompt), n)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_moe")
    g = build_gemma4_moe(str(root / "gemma4_moe"))
    wide = build_qwen3_moe(str(root / "qwen3_wide"), hidden_size=256, moe_intermediate_size=128, num_hidden_layers=2)
    return {"gemma4_moe": g, "qwen3_moe": build_qwen3_moe(str(root / "qwen3_moe")),
            "assistant": build_assistant(str(root / "assistant"), g), "root": root,
            # FP8 experts: per-expert modules with 128 x 128 block scales (kept per 128-row
            # group), and Gemma 4's fused experts with per-channel scales
            "qwen3_fp8": quantize_checkpoint(rewrite_experts(wide, "per_expert"), str(root / "qwen3_fp8"),
                                             "ct-block", acts="none"),
            "gemma4_fp8": quantize_checkpoint(g, str(root / "gemma4_fp8"), "ct-channel", acts="none")}


def _run(eng, prompts):
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, max_new_tokens=NEW, ignore_eos=True)
    eng.run()
    return [eng.tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ["gemma4_moe", "qwen3_moe"])
@pytest.mark.parametrize("overlap", [True, False])
def test_moe_parity_cuda_graphs(ckpts, arch, overlap):
    d = ckpts[arch]
    eng = InProcEngine(d, overlap=overlap, device="cuda", dtype="float32", chunked_prefill_size=16,
                       max_total_tokens=65536)
    assert eng.runner.graphs is not None
    got = _run(eng, PROMPTS * 2)
    assert got == [hf_greedy_cuda(d, p, NEW) for p in PROMPTS * 2]


@pytest.mark.parametrize("draft", ["assistant", "oracle"])
@pytest.mark.parametrize("overlap", [True, False])
def test_moe_mtp_parity_cuda_graphs(ckpts, draft, overlap):
    d = ckpts["gemma4_moe"]
    prompts = PROMPTS * 4
    refs = [hf_greedy_cuda(d, p, NEW) for p in prompts]
    oracle = draft == "oracle"  # drafts often right: verify rows of 4 tokens through the experts
    eng = InProcEngine(d, draft=ckpts["assistant"], steps=3, overlap=overlap, device="cuda", dtype="float32",
                       chunked_prefill_size=16, max_total_tokens=65536, disable_cuda_graph=oracle)
    if oracle:  # swapped in before the graphs are captured, so they replay its drafts
        table = bigram_table([p + r for p, r in zip(prompts, refs)])
        eng.runner.assistant = BigramDraft(eng.runner.target, table).cuda()
        eng.runner.enable_graphs([1, 2, 4, 8, 16, 32])
        eng.runner.enable_prefill_graphs(8192)
    assert eng.runner.graphs is not None
    assert _run(eng, prompts) == refs
    if draft == "oracle":
        assert sum(eng.core.counters.per_pos) > 20


@pytest.mark.parametrize("arch", ["qwen3_fp8", "gemma4_fp8"])
def test_weight_only_fp8_moe_is_hf_on_the_dequantized_weights_with_graphs(ckpts, arch):
    kw = dict(device="cuda", dtype="float32", chunked_prefill_size=16, max_total_tokens=65536)
    eng = InProcEngine(ckpts[arch], **kw)
    layer = eng.runner.target.model.layers[0]
    experts = layer.experts if arch == "gemma4_fp8" else layer.mlp.experts
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert _run(eng, PROMPTS) == [hf_greedy_cuda(dequantized(ckpts[arch]), p, NEW) for p in PROMPTS]


def test_mtp_on_an_fp8_moe_target_with_fp8_kv_is_lossless_with_graphs(ckpts):
    kw = dict(device="cuda", dtype="float32", chunked_prefill_size=16, max_total_tokens=65536, quantization="fp8",
              kv_cache_dtype="fp8_e4m3")
    plain = _run(InProcEngine(ckpts["gemma4_moe"], **kw), PROMPTS)
    assert _run(InProcEngine(ckpts["gemma4_moe"], draft=ckpts["assistant"], **kw), PROMPTS) == plain


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("arch", ["gemma4_moe", "qwen3_moe"])
def test_moe_bf16_graphs_match_eager(ckpts, arch, quantization):
    d = ckpts[arch]
    kw = dict(device="cuda", dtype="bfloat16", chunked_prefill_size=16, max_total_tokens=65536,
              quantization=quantization)
    eager = _run(InProcEngine(d, disable_cuda_graph=True, disable_piecewise_cuda_graph=True, **kw), PROMPTS)
    graphed = _run(InProcEngine(d, **kw), PROMPTS)
    assert graphed == eager
