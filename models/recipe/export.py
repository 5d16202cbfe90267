"""Export (bf16 safetensors, HF configs, tokenizer files) and verification against transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .arch import (DRAFT_POSITION, FULL, POSITION_OFFSETS, SLIDING, Assistant, TargetLM, TextArch,
                   draft_all_positions, frozen_kv_masks, target_kv_for_draft)
from .data import BOS_ID, EOS_IDS, PAD_ID
from .target import generate

TOKEN_IDS = {"pad_token_id": PAD_ID, "eos_token_id": list(EOS_IDS), "bos_token_id": BOS_ID}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def log(msg: str) -> None:
    print(msg, flush=True)


def hf_text_config(arch: TextArch, *, token_ids: dict, num_kv_shared_layers: int = 0) -> dict:
    """A gemma4_text config dict that transformers 5.17 and 5.23+ read identically.

    Full and sliding layers share head_dim and kv heads. Old readers take the full-layer shape
    from `global_head_dim` / `num_global_key_value_heads`; new ones from `per_layer_config`;
    both are written with the same values, so every reader builds one homogeneous model.
    """
    full = [i for i, t in enumerate(arch.layer_types) if t == FULL]
    width = len(str(max(full)))
    return {
        "model_type": "gemma4_text",
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "global_head_dim": arch.head_dim,
        "num_global_key_value_heads": arch.num_key_value_heads,
        "per_layer_config": {str(i).zfill(width): {"head_dim": arch.head_dim,
                                                   "num_key_value_heads": arch.num_key_value_heads}
                             for i in full},
        "layer_types": list(arch.layer_types),
        "sliding_window": arch.sliding_window,
        "rope_parameters": arch.rope_parameters(),
        "final_logit_softcapping": arch.final_logit_softcapping,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": arch.rms_norm_eps,
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": False,
        "use_bidirectional_attention": None,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "num_kv_shared_layers": num_kv_shared_layers,
        "enable_moe_block": False,
        "use_double_wide_mlp": False,
        "num_experts": None,
        "top_k_experts": None,
        "moe_intermediate_size": None,
        "tie_word_embeddings": True,
        "use_cache": True,
        **token_ids,
    }


def save_weights(module: torch.nn.Module, path: Path) -> None:
    sd = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in module.state_dict().items()}
    save_file(sd, str(path), metadata={"format": "pt"})
    path.chmod(0o644)


def target_config(arch: TextArch) -> dict:
    return {"architectures": ["Gemma4ForCausalLM"], **hf_text_config(arch, token_ids=TOKEN_IDS),
            "dtype": "bfloat16"}


def assistant_config(arch: TextArch, backbone_hidden_size: int) -> dict:
    text = hf_text_config(arch, token_ids=TOKEN_IDS, num_kv_shared_layers=arch.num_hidden_layers)
    return {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": backbone_hidden_size,
        "use_ordered_embeddings": False,
        "num_centroids": 2048,
        "centroid_intermediate_top_k": 32,
        "tie_word_embeddings": True,
        "text_config": text,
        **TOKEN_IDS,
        "dtype": "bfloat16",
    }


def export_pair(out: Path, target: TargetLM, assistant: Assistant, tokenizer_dir: Path,
                num_assistant_tokens: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    gen = {**TOKEN_IDS}
    dirs = {"target": out / "target", "assistant": out / "assistant"}
    for d in dirs.values():
        d.mkdir(exist_ok=True)
        for f in TOKENIZER_FILES:
            shutil.copyfile(tokenizer_dir / f, d / f)
    save_weights(target, dirs["target"] / "model.safetensors")
    save_weights(assistant, dirs["assistant"] / "model.safetensors")
    (dirs["target"] / "config.json").write_text(json.dumps(target_config(target.arch), indent=2) + "\n")
    (dirs["assistant"] / "config.json").write_text(
        json.dumps(assistant_config(assistant.arch, target.arch.hidden_size), indent=2) + "\n")
    (dirs["target"] / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (dirs["assistant"] / "generation_config.json").write_text(json.dumps(
        {**gen, "num_assistant_tokens": num_assistant_tokens,
         "num_assistant_tokens_schedule": "constant"}, indent=2) + "\n")
    sizes = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    return sizes


def load_exported(out: Path, target_arch: TextArch, draft_arch: TextArch, device,
                  dtype=torch.float32):
    """Our modules with the exported (bf16-rounded) weights, in `dtype`."""
    tgt = TargetLM(target_arch)
    tgt.load_state_dict({k: v.float() for k, v in load_file(str(out / "target/model.safetensors")).items()})
    ast = Assistant(draft_arch, target_arch.hidden_size)
    ast.load_state_dict({k: v.float() for k, v in load_file(str(out / "assistant/model.safetensors")).items()})
    return tgt.to(device, dtype).eval(), ast.to(device, dtype).eval()


# ----------------------------------------------------------------------------------------------
# verification with HF transformers


def patch_kv_sharing_modes() -> None:
    """transformers >= 5.23 derives kv_sharing_modes; if it raises for an all-shared assistant
    text config, fall back to every layer reusing KV. 5.17 has no such property."""
    from transformers import Gemma4TextConfig

    prop = Gemma4TextConfig.__dict__.get("kv_sharing_modes")
    if not isinstance(prop, property) or getattr(prop.fget, "_tandem_patched", False):
        return

    def safe(self):
        try:
            return prop.fget(self)
        except Exception:
            return ["reuse"] * self.num_hidden_layers

    safe._tandem_patched = True
    Gemma4TextConfig.kv_sharing_modes = property(safe)


def verify_with_hf(out: Path, target_arch: TextArch, draft_arch: TextArch, val_ids: np.ndarray,
                   steps: int, device, gen_tokens: int = 40) -> dict:
    """Load both dirs with transformers, check keys, and compare against our modules in fp32:
    target logits on a held-out row; the assistant's S-step chain from several committed
    lengths c with shared_kv_states restricted to exactly [0, c) (sliding: the last
    `sliding_window` of them) and position_ids [[c]]; greedy generate; tokenizer round trip."""
    import transformers

    patch_kv_sharing_modes()
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # true fp32
    try:
        return _verify(out, target_arch, draft_arch, val_ids, steps, device, gen_tokens, transformers)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


@torch.no_grad()
def _verify(out, target_arch, draft_arch, val_ids, steps, device, gen_tokens, transformers) -> dict:
    from transformers import AutoTokenizer, Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    res = {"transformers_version": transformers.__version__}
    hf_t, info_t = Gemma4ForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32,
                                                     output_loading_info=True)
    hf_a, info_a = Gemma4AssistantForCausalLM.from_pretrained(str(out / "assistant"), dtype=torch.float32,
                                                              output_loading_info=True)
    for name, info in (("target", info_t), ("assistant", info_a)):
        bad = {k: list(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys",
                                                           "mismatched_keys") and v}
        res[f"{name}_load_problems"] = bad
        assert not bad, f"{name}: {bad}"
    hf_t.to(device).eval()
    hf_a.to(device).eval()
    tgt, ast = load_exported(out, target_arch, draft_arch, device)

    ids = torch.from_numpy(val_ids[None].astype(np.int64)).to(device)
    length = ids.shape[1]
    kv_layers = tuple(tgt.kv_source.values())
    logits, h, kvs = tgt(ids, kv_layers=kv_layers)
    o = hf_t(input_ids=ids, use_cache=False, return_shared_kv_states=True)
    res["target_logits_max_abs_diff"] = (o.logits - logits).abs().max().item()
    res["target_argmax_equal"] = bool((o.logits.argmax(-1) == logits.argmax(-1)).all())
    hf_h = hf_t.model(input_ids=ids, use_cache=False).last_hidden_state

    # assistant chain vs ours (all committed lengths at once, teacher-forced on the row)
    offset = POSITION_OFFSETS[DRAFT_POSITION]
    ours = draft_all_positions(tgt, ast, ids, h, target_kv_for_draft(tgt, kvs), steps, offset,
                               frozen_kv_masks(length, target_arch.sliding_window, device))
    skv = o.shared_kv_states
    w = target_arch.sliding_window
    cs = sorted({1, 2, min(w, length - steps - 1), min(w + 7, length - steps - 1), length - steps - 1})
    max_diff, same = 0.0, True
    embed = hf_t.get_input_embeddings()
    for c in cs:
        shared = {FULL: (skv[FULL][0][:, :, :c], skv[FULL][1][:, :, :c]),
                  SLIDING: (skv[SLIDING][0][:, :, max(0, c - w):c], skv[SLIDING][1][:, :, max(0, c - w):c])}
        prev = hf_h[:, c - 1:c]
        for k in range(1, steps + 1):
            tok = ids[:, c + k - 1:c + k]
            r = hf_a(inputs_embeds=torch.cat([embed(tok), prev], -1), shared_kv_states=shared,
                     position_ids=torch.tensor([[c + offset]], device=device), use_cache=False)
            prev = r.last_hidden_state
            max_diff = max(max_diff, (r.logits[:, 0] - ours[k - 1][:, c]).abs().max().item())
            same &= bool((r.logits[:, 0].argmax(-1) == ours[k - 1][:, c].argmax(-1)).all())
    res["assistant_committed_lengths_checked"] = cs
    res["assistant_logits_max_abs_diff"] = max_diff
    res["assistant_argmax_equal"] = same

    # greedy generation: HF vs ours (fp32)
    prompt = ids[:, :min(32, length)]
    hf_gen = hf_t.generate(prompt, max_new_tokens=gen_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=PAD_ID)
    mine = generate(tgt, prompt, torch.full((1,), prompt.shape[1], device=device),
                    prompt.shape[1] + gen_tokens, torch.zeros(1, prompt.shape[1] + gen_tokens, device=device))
    n = hf_gen.shape[1]  # HF may stop early at <eos>/<end_of_turn>; ours runs to the length
    res["greedy_generate_equal"] = bool(torch.equal(hf_gen[0], mine[0, :n]))
    try:  # HF's own frozen-KV MTP assisted generation must reproduce plain greedy
        hf_asst = hf_t.generate(prompt, max_new_tokens=gen_tokens, do_sample=False, eos_token_id=None,
                                pad_token_id=PAD_ID, assistant_model=hf_a)
        res["hf_assisted_generate_equal"] = bool(torch.equal(hf_asst[0], hf_gen[0]))
    except Exception as e:  # informative only
        res["hf_assisted_generate_equal"] = f"error: {type(e).__name__}: {e}"[:300]

    tok = AutoTokenizer.from_pretrained(str(out / "target"))
    res["hf_generate_text"] = tok.decode(hf_gen[0, prompt.shape[1]:], skip_special_tokens=False)
    res["prompt_text"] = tok.decode(prompt[0], skip_special_tokens=False)
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(out / "target/tokenizer.json"))
    s = res["prompt_text"].replace("<bos>", "")
    res["tokenizer_libraries_agree"] = tok(s)["input_ids"] == raw.encode(s).ids
    try:  # needs jinja2
        res["chat_template_sample"] = tok.apply_chat_template(
            [{"role": "user", "content": "Who is there?"}], tokenize=False, add_generation_prompt=True)
    except Exception as e:  # informative only
        res["chat_template_sample"] = f"error: {type(e).__name__}: {e}"[:300]
    return res
