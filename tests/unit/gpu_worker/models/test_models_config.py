"""config.json parsing: HF's derived defaults, both Gemma 4 serialisations, EOS ids, errors."""

from __future__ import annotations

import json

import pytest

from gpu_worker.models.config import (
    FULL,
    SLIDING,
    Gemma4Spec,
    LlamaSpec,
    MoESpec,
    parse_config,
)
from gpu_worker.models.eos import read_eos_token_ids

transformers = pytest.importorskip("transformers")

_GEMMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    layer_types=[SLIDING, FULL, SLIDING, FULL],
    sliding_window=6,
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=256,
)


def _hf_dict(config) -> dict:
    d = config.to_dict()
    d["architectures"] = ["Gemma4ForCausalLM"]
    return d


def _old_format(new: dict, global_head_dim: int | None, num_global_kv: int | None) -> dict:
    """The same model as a pre-per_layer_config release (or the Hub's older files) writes it."""
    old = {k: v for k, v in new.items() if k != "per_layer_config"}
    if global_head_dim is not None:
        old["global_head_dim"] = global_head_dim
    old["num_global_key_value_heads"] = num_global_kv
    return old


@pytest.mark.parametrize("k_eq_v", [False, True])
def test_gemma4_old_and_new_serialisations_agree(k_eq_v):
    cfg = transformers.Gemma4TextConfig(
        **_GEMMA, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=k_eq_v
    )
    new = parse_config(_hf_dict(cfg))
    old_dict = _old_format(_hf_dict(cfg), 32, 1)
    old = parse_config(old_dict)
    assert isinstance(new, Gemma4Spec) and new == old
    # num_global_key_value_heads only applies with attention_k_eq_v (HF's rule)
    assert [(l.head_dim, l.num_kv_heads) for l in new.layers] == [
        (16, 2),
        (32, 1 if k_eq_v else 2),
        (16, 2),
        (32, 1 if k_eq_v else 2),
    ]
    assert [l.k_eq_v for l in new.layers] == [False, k_eq_v, False, k_eq_v]
    # and HF itself reads the old form the same way
    hf_old = transformers.Gemma4TextConfig(**{k: v for k, v in old_dict.items() if k != "architectures"})
    for i, layer in enumerate(new.layers):
        per = hf_old.per_layer_config[i]
        assert (per.head_dim, per.num_key_value_heads) == (layer.head_dim, layer.num_kv_heads)


def test_gemma4_defaults_follow_hf():
    raw = {
        "architectures": ["Gemma4ForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
    }
    spec = parse_config(raw)
    hf = transformers.Gemma4TextConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    # default pattern 5 sliding : 1 full, and the last layer forced to full
    assert [l.layer_type for l in spec.layers] == hf.layer_types == [SLIDING] * 5 + [FULL, FULL]
    assert [l.head_dim for l in spec.layers] == [256] * 5 + [512, 512]  # global_head_dim default 512
    assert [l.num_kv_heads for l in spec.layers] == [4] * 7
    full, sliding = spec.layers[-1].rope, spec.layers[0].rope
    assert (full.rope_type, full.theta, full.partial_rotary_factor) == ("proportional", 1e6, 0.25)
    assert (sliding.rope_type, sliding.theta) == ("default", 1e4)
    assert spec.layers[0].sliding_window == 512 and spec.layers[-1].sliding_window is None
    assert spec.tie_word_embeddings and spec.final_logit_softcapping is None
    assert spec.hidden_size_per_layer_input == 256  # HF default: PLE on


def test_gemma4_kv_sharing_sources():
    raw = _hf_dict(
        transformers.Gemma4TextConfig(
            **{**_GEMMA, "num_hidden_layers": 6, "layer_types": [SLIDING, FULL, SLIDING, SLIDING, SLIDING, FULL]},
            num_kv_shared_layers=3,
            use_double_wide_mlp=True,
        )
    )
    spec = parse_config(raw)
    assert [l.kv_source for l in spec.layers] == [None, None, None, 2, 2, 1]
    assert [l.intermediate_size for l in spec.layers] == [96, 96, 96, 192, 192, 192]


def test_gemma4_unsupported_variants():
    base = _hf_dict(transformers.Gemma4TextConfig(**_GEMMA))
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        parse_config({**base, "use_bidirectional_attention": "all"})
    with pytest.raises(ValueError, match="LlamaForCausalLM"):  # lists what is supported
        parse_config({**base, "architectures": ["GPT2LMHeadModel"]})


_MOE = {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 32}


def test_gemma4_moe_block_on_every_layer():
    base = _hf_dict(transformers.Gemma4TextConfig(**_GEMMA))
    spec = parse_config({**base, **_MOE})
    assert {l.moe for l in spec.layers} == {MoESpec(8, 2, 32, "gemma4", True)}
    assert all(l.moe is None for l in parse_config(base).layers)


@pytest.mark.parametrize("change,field", [
    ({"num_experts": None}, "num_experts"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ({"top_k_experts": 9}, "top_k_experts"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"n_shared_experts": 1}, "n_shared_experts"),
])
def test_unsupported_moe_variants_name_the_field(change, field):
    base = _hf_dict(transformers.Gemma4TextConfig(**_GEMMA))
    with pytest.raises(ValueError, match=field) as err:
        parse_config({**base, **_MOE, **change})
    assert "\n" not in str(err.value)
    qwen = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4,
            "num_hidden_layers": 2, "intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 5,
            "moe_intermediate_size": 16}
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        parse_config(qwen)
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        parse_config({**qwen, "num_experts_per_tok": 2, "decoder_sparse_step": 0})


def test_gemma4_multimodal_wrapper_parses_its_text_config():
    text = _hf_dict(transformers.Gemma4TextConfig(**_GEMMA, global_head_dim=32))
    wrapped = parse_config({"architectures": ["Gemma4ForConditionalGeneration"], "text_config": text})
    assert wrapped.layers == parse_config(text).layers and wrapped.tie_word_embeddings


def test_qwen_sliding_window_needs_use_sliding_window():
    base = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, max_window_layers=1,
    )
    off = parse_config({**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False})
    on = parse_config({**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True})
    assert [l.sliding_window for l in off.layers] == [None, None, None]
    assert [l.sliding_window for l in on.layers] == [None, 8, 8]
    assert on.qkv_bias and not on.o_bias
    llama = parse_config({**base, "architectures": ["LlamaForCausalLM"]})
    assert isinstance(llama, LlamaSpec) and [l.sliding_window for l in llama.layers] == [None] * 3
    mistral = parse_config({**base, "architectures": ["MistralForCausalLM"]})
    assert [l.sliding_window for l in mistral.layers] == [8] * 3


def test_legacy_rope_keys():
    raw = dict(
        architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=96,
        num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=4096, rope_theta=500000.0,
        rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    )
    rope = parse_config(raw).layers[0].rope
    assert (rope.rope_type, rope.theta, rope.factor, rope.original_max_position_embeddings) == (
        "llama3", 500000.0, 8.0, 8192)
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        parse_config({**raw, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_read_eos_token_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert read_eos_token_ids(tmp_path) == (1,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [106, 1]}))
    assert read_eos_token_ids(tmp_path) == (106, 1)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": [1, 50]}}))
    assert read_eos_token_ids(tmp_path) == (106, 1, 50)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert read_eos_token_ids(tmp_path) == ()


def test_tokenizer_eos_stops_too(tmp_path):
    """The tokenizer's EOS token ends a request even where the configs do not list it (vLLM and
    SGLang stop on it): resolved through tokenizer.json, from the tokenizer directory when it is
    not the model's; absent or unknown tokens add nothing."""
    from tests.helpers.checkpoints import build_tokenizer

    tok_dir = tmp_path / "tok"
    build_tokenizer(str(tok_dir))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert read_eos_token_ids(tmp_path) == (7,)  # no tokenizer in the model directory
    assert read_eos_token_ids(tmp_path, tok_dir) == (7, 2)  # "</s>"
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    for eos, want in (({"content": "<|end|>", "special": True}, (7, 5)), ("<not-a-token>", (7,)), (None, (7,))):
        (tok_dir / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": eos}))
        assert read_eos_token_ids(tmp_path, tok_dir) == want, eos
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert read_eos_token_ids(tmp_path, tok_dir) == (5, 7)  # already listed: once, in config order
