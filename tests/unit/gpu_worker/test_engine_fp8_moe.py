"""FP8 MoE experts through the scheduler + worker (in-process, CPU twin and the kernels under
Triton's interpreter).

The experts stay e4m3 in memory with their scales (``quant/fp8_experts.py``). Weight-only FP8
checkpoints in both expert layouts (per-expert modules, as the Hub's FP8 MoE releases ship, and
HF's fused 3-D tensors with ``*_scale_inv``) decode what HF decodes on the dequantized
checkpoint, token for token; online FP8 (``--quantization fp8``) tracks the unquantized model
within the FP8 bound (``fp8_compare.py``), and MTP on an FP8 MoE target with the FP8 KV cache
is lossless against the same engine without MTP.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.models.loader import load_model
from gpu_worker.quant.fp8_math import quantize_rows
from tests.helpers.checkpoints import build_assistant, build_gemma4_moe, build_qwen3_moe, hf_greedy, rewrite_experts
from tests.helpers.fp8_checkpoints import dequantized, quantize_checkpoint
from tests.helpers.fp8_compare import NEW, PROMPTS, compare, fp8_bound, generate
from tests.helpers.inproc import InProcEngine

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_moe")
    g = build_gemma4_moe(str(root / "g"))
    return {
        "root": root,
        "qwen3_moe": build_qwen3_moe(str(root / "q")),
        # experts wide enough for whole 128 x 128 blocks: scales kept once per 128-row group
        "qwen3_moe_wide": build_qwen3_moe(str(root / "qw"), hidden_size=256, moe_intermediate_size=128,
                                          num_hidden_layers=2),
        "gemma4_moe": g,
        "assistant": build_assistant(str(root / "a"), g),
    }


def _experts(path: str, **kw):
    """The first layer's ``Experts`` as the loader builds them (Gemma 4's on the layer, Qwen3's
    under ``mlp``)."""
    layer = load_model(path, torch.float32, "cpu", **kw).model.layers[0]
    return layer.experts if hasattr(layer, "experts") else layer.mlp.experts


CHECKPOINTS = {  # case -> (model, expert layout, FP8 layout, shards)
    "qwen3-per-expert-block": ("qwen3_moe", "per_expert", "ct-block", 2),
    "qwen3-fused-block-wide": ("qwen3_moe_wide", "fused", "ct-block", 1),
    "qwen3-per-expert-tensor": ("qwen3_moe", "per_expert", "ct-tensor", 1),
    "gemma4-fused-channel": ("gemma4_moe", "fused", "ct-channel", 1),
}


def _quantized(ckpts, case: str) -> str:
    model, layout, fp8, shards = CHECKPOINTS[case]
    out = ckpts["root"] / f"{case}-fp8"
    if not out.exists():
        src = str(ckpts["root"] / f"{case}-src")
        shutil.copytree(ckpts[model], src)
        quantize_checkpoint(rewrite_experts(src, layout, shards), str(out), fp8, acts="none")
    return str(out)


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_weight_only_fp8_experts_are_hf_on_the_dequantized_weights(ckpts, case):
    q = _quantized(ckpts, case)
    want = [hf_greedy(dequantized(q), p, NEW, ignore_eos=True) for p in PROMPTS]
    assert generate(q) == want
    experts = _experts(q)
    assert experts.gate_up_proj.dtype == FP8 and experts.down_proj.dtype == FP8  # e4m3 in memory
    assert experts.scale_rows == (128 if case == "qwen3-fused-block-wide" else 1)


@pytest.mark.parametrize("case", ["qwen3-per-expert-block", "qwen3-fused-block-wide"])
def test_fp8_experts_on_the_kernel_path(ckpts, case, monkeypatch):
    """The same through the MoE kernels (decode path and grouped GEMM, dequantizing tiles in
    registers) with the CUDA-graph decode path emulated."""
    monkeypatch.setenv("TANDEM_EMULATE_CUDA_GRAPHS", "1")
    q = _quantized(ckpts, case)
    want = [hf_greedy(dequantized(q), p, 5, ignore_eos=True) for p in PROMPTS[:3]]
    assert generate(q, PROMPTS[:3], 5, attention_backend="triton", cuda_graph_bs=(1, 2, 4)) == want


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma4_moe"])
def test_online_fp8_quantizes_each_expert_per_output_channel(ckpts, arch):
    """The experts in memory are exactly ``quantize_rows`` of each checkpoint expert's rows (HF
    saves Qwen3-MoE's per expert, Gemma 4's fused: both loaders)."""
    experts = _experts(ckpts[arch], quantization="fp8")
    t = load_file(os.path.join(ckpts[arch], "model.safetensors"))
    for e in (0, 5):
        if arch == "gemma4_moe":
            gate_up = t["model.layers.0.experts.gate_up_proj"][e]
        else:
            gate_up = torch.cat([t[f"model.layers.0.mlp.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")])
        w8, s = quantize_rows(gate_up.float())
        assert torch.equal(experts.gate_up_proj[e].view(torch.uint8), w8.view(torch.uint8))
        assert torch.equal(experts.gate_up_scale[e], s)


def test_online_fp8_experts_track_the_unquantized_model(ckpts):
    """Greedy agreement and logprob error of online FP8 against float32 (Qwen3-MoE; the tiny
    random Gemma 4 MoE flips a fifth of its greedy picks in bf16 already, too chaotic for a
    meaningful bound: its experts are checked exactly above and its MTP below)."""
    arch = "qwen3_moe"
    compare(ckpts[arch], ckpts[arch], fp8_bound(ckpts[arch], arch), f"online FP8 vs float32 ({arch})",
            quantization="fp8")


def test_mtp_on_an_fp8_moe_target_with_fp8_kv_is_lossless(ckpts):
    kw = dict(quantization="fp8", kv_cache_dtype="fp8_e4m3")
    plain = generate(ckpts["gemma4_moe"], **kw)
    eng = InProcEngine(ckpts["gemma4_moe"], draft=ckpts["assistant"], page_size=4, chunked_prefill_size=32, **kw)
    assert eng.runner.target.model.layers[0].experts.quant is not None
    for i, p in enumerate(PROMPTS):
        eng.submit(f"r{i}", p, max_new_tokens=NEW, ignore_eos=True)
    eng.run()
    assert [eng.tokens[f"r{i}"] for i in range(len(PROMPTS))] == plain


def test_dummy_weights_give_fp8_experts(ckpts):
    m = load_model(ckpts["qwen3_moe"], torch.bfloat16, "cpu", load_format="dummy", quantization="fp8")
    experts = m.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == FP8
    assert bool((experts.gate_up_scale > 0).all()) and bool((experts.down_scale > 0).all())
    assert generate(ckpts["qwen3_moe"], PROMPTS[:1], 3, load_format="dummy", quantization="fp8",
                    dtype="bfloat16")[0]


def test_a_missing_expert_scale_is_named(ckpts, tmp_path):
    """Static activation scales beside it (read and dropped for experts) do not hide it."""
    src = str(ckpts["root"] / "static-src")
    shutil.copytree(ckpts["qwen3_moe"], src)
    q = quantize_checkpoint(rewrite_experts(src, "per_expert"), str(tmp_path / "static"), "ct-tensor", "static")
    assert _experts(q).gate_up_proj.dtype == FP8  # the whole checkpoint loads
    bad = tmp_path / "bad"
    os.makedirs(bad)
    for f in os.listdir(q):
        if os.path.isfile(os.path.join(q, f)) and not f.endswith(".safetensors"):
            os.symlink(os.path.join(q, f), bad / f)
    tensors = load_file(os.path.join(q, "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight_scale"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.3\.up_proj\.weight_scale"):
        load_model(str(bad))


def test_block_fp8_checkpoint_with_dynamic_activations_tracks_its_dequantized_weights(ckpts):
    """The layout of the Hub's FP8 MoE releases (``quant_method: fp8``, 128 x 128
    ``weight_scale_inv`` per expert module, dynamic activations): the experts load e4m3; the
    dense projections quantize their activations, the experts do not."""
    src = str(ckpts["root"] / "hub-src")
    shutil.copytree(ckpts["qwen3_moe"], src)
    q = quantize_checkpoint(rewrite_experts(src, "per_expert", 2), str(ckpts["root"] / "hub-fp8"), "block", "dynamic")
    experts = _experts(q)
    assert experts.gate_up_proj.dtype == FP8 and experts.gate_up_scale.shape[2] == 1  # 64 columns: one block
    compare(dequantized(q), q, fp8_bound(dequantized(q), "qwen3_moe"), "block FP8, dynamic activations vs "
            "its dequantized weights in float32 (qwen3_moe)")
