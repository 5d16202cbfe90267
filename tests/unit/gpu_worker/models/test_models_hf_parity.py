"""Our target models vs HF transformers, float32 on CPU, through the paged KV pool.

Each case builds a tiny random HF model, saves it with save_pretrained, loads it with our
loader and compares logits for (a) a multi-sequence flat prefill and (b) chunked prefill across
two forwards followed by decode steps, against HF's logits of the full sequences.
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker.models.loader import load_model
from tests.unit.model_harness import TEST_DEVICE, PagedHarness, hf_logits, randomize_hf_

transformers = pytest.importorskip("transformers")

VOCAB = 256
ATOL = RTOL = 1e-4


def _make(config_cls, **kw):
    """Build an HF config; retry with legacy spellings for keys an older release lacks."""
    try:
        return config_cls(**kw)
    except TypeError:
        if "rope_parameters" in kw:
            kw["rope_scaling"] = kw.pop("rope_parameters")
        return config_cls(**kw)


_LLAMA_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
)

_GEMMA_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,  # full layers: a different head_dim than sliding ones
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    sliding_window=6,  # shorter than the prompts
    final_logit_softcapping=30.0,
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=VOCAB,
    max_position_embeddings=256,
    pad_token_id=0,
)


def _llama(**kw):
    return transformers.LlamaForCausalLM, _make(transformers.LlamaConfig, **{**_LLAMA_BASE, **kw})


def _gemma(**kw):
    return transformers.Gemma4ForCausalLM, _make(transformers.Gemma4TextConfig, **{**_GEMMA_BASE, **kw})


CASES = {
    "llama": lambda: _llama(),
    "llama3_rope_bias_tied": lambda: _llama(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
    ),
    "mistral_sliding": lambda: (
        transformers.MistralForCausalLM,
        _make(transformers.MistralConfig, **{**_LLAMA_BASE, "sliding_window": 5}),
    ),
    "qwen2_bias_sliding": lambda: (
        transformers.Qwen2ForCausalLM,
        _make(
            transformers.Qwen2Config,
            **{**_LLAMA_BASE, "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
        ),
    ),
    "qwen3_qknorm": lambda: (
        transformers.Qwen3ForCausalLM,
        _make(transformers.Qwen3Config, **{**_LLAMA_BASE, "head_dim": 24}),
    ),
    "gemma4": lambda: _gemma(),
    "gemma4_k_eq_v": lambda: _gemma(attention_k_eq_v=True, num_global_key_value_heads=1),
    "gemma4_ple_kv_shared": lambda: _gemma(
        num_hidden_layers=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        use_double_wide_mlp=True,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
    ),
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """name -> (hf model, our model), built lazily once per module."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            cls, cfg = CASES[name]()
            torch.manual_seed(0)
            hf = cls(cfg).eval()
            randomize_hf_(hf, seed=len(cache))
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(path)
            cache[name] = (hf, load_model(path, dtype=torch.float32, device=TEST_DEVICE))
        return cache[name]

    return get


def _seqs(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_flat_batch_matches_hf(name, pairs):
    hf, ours = pairs(name)
    seqs = _seqs([20, 13, 17], seed=1)  # one short (<=16) and two long rows: both backend groups
    h = PagedHarness(ours.kv_shapes, ours.sliding_windows)
    rows = [(h.new_slot(), s) for s in seqs]
    with torch.inference_mode():
        logits = ours.compute_logits(h.extend(ours, rows)).cpu()
    ref = torch.cat([hf_logits(hf, s) for s in seqs])
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_prefill_then_decode_matches_hf(name, pairs):
    hf, ours = pairs(name)
    steps = 4
    a_full, b_full = _seqs([20 + steps, 15 + steps], seed=2)
    ref_a, ref_b = hf_logits(hf, a_full), hf_logits(hf, b_full)
    h = PagedHarness(ours.kv_shapes, ours.sliding_windows, page_size=4)
    a, b = h.new_slot(), h.new_slot()
    plan = [
        ([(a, a_full[:11]), (b, b_full[:6])], [ref_a[:11], ref_b[:6]]),
        ([(a, a_full[11:20]), (b, b_full[6:15])], [ref_a[11:20], ref_b[6:15]]),
    ]
    for k in range(steps):  # decode: one token per row, fed the known next token
        plan.append(([(a, [a_full[20 + k]]), (b, [b_full[15 + k]])], [ref_a[20 + k : 21 + k], ref_b[15 + k : 16 + k]]))
    with torch.inference_mode():
        for i, (rows, refs) in enumerate(plan):
            logits = ours.compute_logits(h.extend(ours, rows)).cpu()
            torch.testing.assert_close(logits, torch.cat(refs), atol=ATOL, rtol=RTOL, msg=lambda m: f"step {i}: {m}")


def test_gemma4_kv_sharing_layout(pairs):
    """Shared layers own no pool tensor and point at the last earlier owner of their type."""
    _, ours = pairs("gemma4_ple_kv_shared")
    # layers: s0 f1 s2 | s3 f4 shared -> owners 0, 1, 2 own KV; 3 -> 2, 4 -> 1
    assert [(s.num_kv_heads, s.head_dim) for s in ours.kv_shapes] == [(2, 16), (1, 32), (2, 16)]
    attn = [layer.self_attn.attn for layer in ours.model.layers]
    assert [a.kv_layer for a in attn] == [0, 1, 2, 2, 1]
    assert [a.writes_kv for a in attn] == [True, True, True, False, False]
    assert ours.kv_owner_for_type("sliding_attention") == 2
    assert ours.kv_owner_for_type("full_attention") == 1
    assert ours.sliding_windows == (6,)


def test_embed_matches_hf(pairs):
    hf, ours = pairs("gemma4")
    ids = torch.tensor([3, 7, 200])
    with torch.inference_mode():
        ref = hf.model.embed_tokens(ids)
        torch.testing.assert_close(ours.embed(ids.to(TEST_DEVICE)).cpu(), ref, atol=0, rtol=0)
