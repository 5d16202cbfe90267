"""Tiny random HF checkpoints built inside the tests (HF transformers is the oracle).

Each directory holds what a real checkpoint holds: config.json, model.safetensors,
tokenizer.json + tokenizer_config.json (with a chat template) and generation_config.json.
"""

from __future__ import annotations

import functools
import json
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
PAD, BOS, EOS = 0, 1, 2
VOCAB = 384
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.",
    "Once upon a time there was a little engine that served tokens all day long.",
    "café naïve résumé Zürich — 日本語のテキスト 😀🚀 numbers 0123456789 !?",
    "def serve(model):\n    return model.generate(prompt, max_tokens=16)\n",
] * 4
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<|user|>' + m['content'] + '<|end|>' }}"
    "{% elif m['role'] == 'assistant' %}{{ '<|assistant|>' + m['content'] + '<|end|>' }}"
    "{% else %}{{ m['content'] + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer(out_dir: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": False,
           "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast",
           "model_max_length": 4096}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS, "eos_token_id": [EOS, 5], "pad_token_id": PAD}, f)
    return tok


def _save(model, out_dir: str) -> str:
    torch.manual_seed(0)
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir)
    return out_dir


def _common(**kw) -> dict:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    base.update(kw)
    return base


def build_llama(out_dir: str, seed: int = 0, **kw) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**_common(**{"tie_word_embeddings": False, **kw}))
    return _save(LlamaForCausalLM(cfg).eval(), out_dir)


def build_qwen3(out_dir: str, seed: int = 0) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(**_common(head_dim=16, tie_word_embeddings=True))
    return _save(Qwen3ForCausalLM(cfg).eval(), out_dir)


def build_qwen3_moe(out_dir: str, seed: int = 0, **kw) -> str:
    """A tiny Qwen3-MoE: 8 experts, top-2, renormalised; layer 1 dense (``mlp_only_layers``)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    args = _common(head_dim=16, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
    args.update(kw)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**args)).eval()
    _scale_up_gemma(model)  # HF's 0.02 init leaves the router's probabilities nearly flat
    return _save(model, out_dir)


MOE_GEMMA = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=24)


def build_gemma4_moe(out_dir: str, seed: int = 0, **kw) -> str:
    """A tiny Gemma 4 with a MoE block in every layer (8 experts, top-2), sliding and full
    layers; router scales away from 1 so they count."""
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(gemma4_config(**{**MOE_GEMMA, **kw})).eval()
    _scale_up_gemma(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("router.scale", "router.per_expert_scale")):
                p.uniform_(0.5, 1.5)
    return _save(model, out_dir)


def rewrite_experts(model_dir: str, layout: str, shards: int = 1) -> str:
    """Rewrite a saved checkpoint's experts in ``layout`` (``fused``: ``experts.gate_up_proj``
    [E, 2I, H] and ``experts.down_proj`` [E, H, I]; ``per_expert``: ``experts.N.gate_proj.weight``
    ...) and split it into ``shards`` safetensors files with an index, as real checkpoints are."""
    import glob
    import re

    from safetensors.torch import load_file, save_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        tensors.update(load_file(f))
        os.remove(f)
    if os.path.exists(os.path.join(model_dir, "model.safetensors.index.json")):
        os.remove(os.path.join(model_dir, "model.safetensors.index.json"))
    per = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    out: dict[str, torch.Tensor] = {}
    grouped: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for k, v in tensors.items():
        m = per.match(k)
        if m:
            grouped.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = v
        elif k.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            grouped.setdefault(k.rsplit(".", 1)[0], {})[(-1, k.rsplit(".", 1)[1])] = v
        else:
            out[k] = v
    for prefix, parts in grouped.items():
        if (-1, "gate_up_proj") in parts:  # fused in the file
            gate_up, down = parts[(-1, "gate_up_proj")], parts[(-1, "down_proj")]
        else:
            n = 1 + max(i for i, _ in parts)
            gate_up = torch.stack([torch.cat([parts[(i, "gate_proj")], parts[(i, "up_proj")]]) for i in range(n)])
            down = torch.stack([parts[(i, "down_proj")] for i in range(n)])
        if layout == "fused":
            out[f"{prefix}.gate_up_proj"], out[f"{prefix}.down_proj"] = gate_up.contiguous(), down.contiguous()
        else:
            inter = gate_up.shape[1] // 2
            for i in range(gate_up.shape[0]):
                out[f"{prefix}.{i}.gate_proj.weight"] = gate_up[i, :inter].contiguous()
                out[f"{prefix}.{i}.up_proj.weight"] = gate_up[i, inter:].contiguous()
                out[f"{prefix}.{i}.down_proj.weight"] = down[i].contiguous()
    names = sorted(out)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: out[k] for k in names[s::shards]}
        save_file(part, os.path.join(model_dir, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return model_dir


def gemma4_config(**kw):
    from transformers import Gemma4TextConfig

    args = _common(num_hidden_layers=4, head_dim=16, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                   hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, final_logit_softcapping=30.0,
                   global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True)
    args.update(kw)
    return Gemma4TextConfig(**args)


def build_gemma4(out_dir: str, seed: int = 0, **kw) -> str:
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(gemma4_config(**kw)).eval()
    _scale_up_gemma(model)
    return _save(model, out_dir)


def _scale_up_gemma(model) -> None:
    """HF initialises Gemma norms so that a random model's logits are nearly flat; widen them so
    greedy argmax is far from ties (token parity must not hinge on 1e-6 differences)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.08)


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False,
              model=None) -> list[int]:
    """HF transformers' greedy continuation (the oracle), new tokens only; ``model``: the
    checkpoint already loaded (on its device) instead of a fresh float32 CPU copy."""
    model = model if model is not None else hf_model(model_dir)
    ids = torch.tensor([prompt_ids], device=model.device)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD)
    if ignore_eos:
        kw["eos_token_id"] = None
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    return out[0, len(prompt_ids):].tolist()


def patch_assistant_kv_sharing() -> None:
    """transformers >= 5.23: Gemma4TextConfig.kv_sharing_modes raises when every layer is
    shared (an assistant); make it report "reuse" for all layers. 5.17 has no such property."""
    from transformers import Gemma4TextConfig

    prop = getattr(Gemma4TextConfig, "kv_sharing_modes", None)
    if not isinstance(prop, property) or getattr(prop.fget, "_tandem_patched", False):
        return

    def modes(self):
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return prop.fget(self)

    modes._tandem_patched = True
    Gemma4TextConfig.kv_sharing_modes = property(modes)


def build_assistant(out_dir: str, target_dir: str, seed: int = 1, ordered: bool = False, **kw) -> str:
    """A random Gemma4AssistantForCausalLM that fits the target in ``target_dir``."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    patch_assistant_kv_sharing()
    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    text = gemma4_config(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         layer_types=["sliding_attention", "full_attention"],
                         num_kv_shared_layers=2, **kw)
    cfg = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=target["hidden_size"],
                                use_ordered_embeddings=ordered, num_centroids=8, centroid_intermediate_top_k=2)
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(cfg).eval()
    _scale_up_gemma(model)
    if ordered:
        model.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB))
    return _save(model, out_dir)


def build_engine_set(root) -> dict[str, str]:
    """Llama, Qwen3, Gemma 4 and a matching assistant under ``root`` (engine parity tests)."""
    g = build_gemma4(str(root / "g"))
    return {"llama": build_llama(str(root / "l")), "qwen3": build_qwen3(str(root / "q")), "gemma4": g,
            "assistant": build_assistant(str(root / "a"), g)}


def build_kernel_set(root) -> dict[str, str]:
    """Every architecture the triton backend serves, dense and MoE, each Gemma 4 with an assistant,
    at two layers (one sliding, one full): the kernel variants of the engine tests' deeper
    checkpoints in less interpreter time (``hopper_record.record_engine``)."""
    two = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    g, g_moe = build_gemma4(str(root / "g"), **two), build_gemma4_moe(str(root / "g_moe"), **two)
    return {"llama": build_llama(str(root / "l"), num_hidden_layers=2), "qwen3": build_qwen3(str(root / "q")),
            "gemma4": g, "assistant": build_assistant(str(root / "a"), g), "qwen3_moe": build_qwen3_moe(str(root / "q_moe")),
            "gemma4_moe": g_moe, "assistant_moe": build_assistant(str(root / "a_moe"), g_moe)}
