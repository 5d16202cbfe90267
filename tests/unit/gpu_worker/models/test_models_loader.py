"""Loader: sharded checkpoints, old-format Gemma 4 configs, dtype casting, dummy weights, errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.models.loader import load_model
from tests.unit.model_harness import TEST_DEVICE, PagedHarness, hf_logits, randomize_hf_

transformers = pytest.importorskip("transformers")

VOCAB = 256
_GEMMA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    sliding_window=6,
    final_logit_softcapping=30.0,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=VOCAB,
    max_position_embeddings=256,
    pad_token_id=0,
)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**_GEMMA)).eval()
    randomize_hf_(hf, seed=7)
    path = tmp_path_factory.mktemp("gemma")
    hf.save_pretrained(path)
    return hf, path


def _prefill_logits(model, seqs):
    h = PagedHarness(model.kv_shapes, model.sliding_windows, dtype=model.model.embed_tokens.weight.dtype)
    rows = [(h.new_slot(), s) for s in seqs]
    with torch.inference_mode():
        return model.compute_logits(h.extend(model, rows)).cpu()


SEQS = [[5, 9, 200, 17, 33, 4, 8, 90, 91, 12, 13], [7, 7, 7, 100, 3]]


def test_sharded_checkpoint(gemma, tmp_path):
    hf, path = gemma
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = load_model(tmp_path, dtype=torch.float32, device=TEST_DEVICE)
    ref = torch.cat([hf_logits(hf, s) for s in SEQS])
    torch.testing.assert_close(_prefill_logits(ours, SEQS), ref, atol=1e-4, rtol=1e-4)


def test_old_format_gemma4_config_loads_same_model(gemma, tmp_path):
    hf, path = gemma
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("per_layer_config")
    cfg.update(global_head_dim=32, num_global_key_value_heads=1)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = load_model(tmp_path, dtype=torch.float32, device=TEST_DEVICE)
    ref = torch.cat([hf_logits(hf, s) for s in SEQS])
    torch.testing.assert_close(_prefill_logits(ours, SEQS), ref, atol=1e-4, rtol=1e-4)


def test_bfloat16_load_keeps_rope_in_float32(gemma):
    hf, path = gemma
    ours = load_model(path, dtype=torch.bfloat16, device=TEST_DEVICE)
    assert ours.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    assert all(r.inv_freq.dtype == torch.float32 for r in ours.model.rotary.values())
    torch.testing.assert_close(
        ours.model.rotary["full_attention"].inv_freq.cpu(), hf.model.rotary_emb.full_attention_inv_freq, atol=0, rtol=0
    )
    logits = _prefill_logits(ours, SEQS)
    ref = torch.cat([hf_logits(hf, s) for s in SEQS])
    assert logits.dtype == torch.float32
    assert (logits - ref).abs().max() < 0.5  # bf16 weights vs float32 HF: close, not exact
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_multimodal_gemma4_checkpoint_served_text_only(tmp_path):
    text = transformers.Gemma4TextConfig(**_GEMMA)
    cfg = transformers.Gemma4Config(text_config=text, vision_config=None, audio_config=None)
    torch.manual_seed(0)
    hf = transformers.Gemma4ForConditionalGeneration(cfg).eval()
    randomize_hf_(hf, seed=8)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32, device=TEST_DEVICE)
    ref = torch.cat([hf_logits(hf, s) for s in SEQS])
    torch.testing.assert_close(_prefill_logits(ours, SEQS), ref, atol=1e-4, rtol=1e-4)


def test_missing_tensor_is_an_error(gemma, tmp_path):
    hf, path = gemma
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors.pop("model.layers.1.mlp.down_proj.weight")
    tensors.pop("model.layers.2.layer_scalar")  # optional: HF initialises it to 1
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight"):
        load_model(tmp_path, dtype=torch.float32, device=TEST_DEVICE)


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="not supported.*Gemma4ForCausalLM.*Qwen3ForCausalLM"):
        load_model(tmp_path)


@pytest.mark.parametrize("arch", ["llama", "gemma4"])
def test_dummy_weights_give_finite_logits(tmp_path, arch):
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4
        )
        cfg.architectures = ["LlamaForCausalLM"]
    else:
        cfg = transformers.Gemma4TextConfig(**_GEMMA)
        cfg.architectures = ["Gemma4ForCausalLM"]
    cfg.save_pretrained(tmp_path)  # config.json only: dummy never reads weights
    model = load_model(tmp_path, dtype=torch.float32, device=TEST_DEVICE, load_format="dummy")
    logits = _prefill_logits(model, SEQS)
    assert logits.shape == (16, VOCAB) and torch.isfinite(logits).all() and logits.std() > 0
