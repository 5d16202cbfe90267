"""Parse a HF checkpoint's ``config.json`` into frozen specs our model code builds from.

We read the raw JSON dict instead of importing ``transformers`` (the worker does not depend on
it), so every default HF derives in its config ``__post_init__`` is reproduced here. Two
serialisations of Gemma 4 exist:

- new (written by the transformers 5.17 and 5.24 wheels we test with): ``per_layer_config`` =
  {"<layer idx>": {"head_dim": .., "num_key_value_heads": ..}} holding only the values that
  differ from the global ones;
- old (earlier releases; e.g. the Hub's Gemma 4 assistant configs): ``global_head_dim``
  (default 512) and ``num_global_key_value_heads`` for the full-attention layers, the latter
  only when ``attention_k_eq_v`` (otherwise full layers keep ``num_key_value_heads``).
HF converts the old form to the new one when ``per_layer_config`` is absent; so do we.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpu_worker.models.moe_config import MoESpec, parse_moe, qwen3_moe_layers

FULL = "full_attention"
SLIDING = "sliding_attention"

_ROPE_TYPES = ("default", "linear", "llama3", "proportional")
_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str  # one of _ROPE_TYPES
    theta: float
    factor: float = 1.0
    partial_rotary_factor: float = 1.0  # only "proportional" uses it (HF "default" ignores it)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3


@dataclass(frozen=True)
class LayerSpec:
    """Attention geometry of one decoder layer (and its MoE block, if it has one)."""

    layer_type: str  # FULL or SLIDING
    head_dim: int
    num_kv_heads: int
    sliding_window: int | None  # None on full layers
    rope: RopeSpec
    intermediate_size: int
    # Gemma 4 KV sharing: the decoder layer whose KV this one reads; -1 = another model's KV
    # (the assistant reads the target's, mapped when it is bound to the target).
    kv_source: int | None = None
    k_eq_v: bool = False  # Gemma 4 attention_k_eq_v on this layer: no v_proj, value = k_proj output
    # Qwen3-MoE: replaces the dense MLP; Gemma 4 (enable_moe_block): runs beside it.
    moe: MoESpec | None = None

    @property
    def owns_kv(self) -> bool:
        return self.kv_source is None


@dataclass(frozen=True)
class LlamaSpec:
    """Llama 2/3, Mistral, Qwen2, Qwen3 (dense and MoE): one pre-norm decoder, differences are
    flags (Qwen3-MoE: the MoE layers' ``LayerSpec.moe``)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_heads: int
    rms_norm_eps: float
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    tie_word_embeddings: bool
    layers: tuple[LayerSpec, ...]


@dataclass(frozen=True)
class Gemma4Spec:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_heads: int
    rms_norm_eps: float
    hidden_act: str
    attention_bias: bool
    final_logit_softcapping: float | None
    hidden_size_per_layer_input: int  # 0 = no Per-Layer Embeddings
    vocab_size_per_layer_input: int
    tie_word_embeddings: bool
    layers: tuple[LayerSpec, ...]


@dataclass(frozen=True)
class Gemma4AssistantSpec:
    architecture: str
    text: Gemma4Spec  # every layer has kv_source set (reads the target's KV)
    backbone_hidden_size: int
    use_ordered_embeddings: bool
    num_centroids: int
    centroid_intermediate_top_k: int
    tie_word_embeddings: bool


ModelSpec = LlamaSpec | Gemma4Spec | Gemma4AssistantSpec


# --------------------------------------------------------------------------- helpers


def _get(cfg: dict, key: str, default: Any) -> Any:
    """cfg[key], treating an explicit JSON null as absent (HF fills its default then)."""
    value = cfg.get(key)
    return default if value is None else value


def _activation(cfg: dict, *keys: str, default: str) -> str:
    act = next((cfg[k] for k in keys if cfg.get(k)), default)
    if act not in _ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
    return act


def parse_rope(params: dict | None, top: dict, default_theta: float = 10_000.0) -> RopeSpec:
    """One RoPE dict (new ``rope_parameters`` or legacy ``rope_scaling``) -> RopeSpec.

    ``top`` is the whole config: legacy checkpoints keep ``rope_theta`` and
    ``partial_rotary_factor`` at the top level.
    """
    params = dict(params or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
    theta = params.get("rope_theta") or top.get("rope_theta") or default_theta
    partial = params.get("partial_rotary_factor") or top.get("partial_rotary_factor") or 1.0
    return RopeSpec(
        rope_type=rope_type,
        theta=float(theta),
        factor=float(params.get("factor", 1.0)),
        partial_rotary_factor=float(partial),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        # HF: a pretraining-time `original_max_position_embeddings` outside the dict wins, then
        # the one inside it, then max_position_embeddings.
        original_max_position_embeddings=int(
            top.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings")
            or top.get("max_position_embeddings")
            or 8192
        ),
    )


# --------------------------------------------------------------------------- Llama family


def _llama_layer_types(cfg: dict, arch: str, n: int) -> tuple[list[str], int | None]:
    """(layer types, window) with each architecture's own rule for when sliding applies."""
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # Qwen keeps `sliding_window` in the JSON even when off; only `use_sliding_window` turns it on.
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        types = cfg.get("layer_types") or [
            SLIDING if window is not None and i >= _get(cfg, "max_window_layers", 28) else FULL for i in range(n)
        ]
        return [t if window is not None else FULL for t in types], window
    if arch == "Qwen3MoeForCausalLM":  # HF: one window on every layer, only with use_sliding_window
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        return [SLIDING if window is not None else FULL] * n, window
    if arch == "MistralForCausalLM":
        window = cfg.get("sliding_window")  # HF Mistral: one window on every layer when set
        return [SLIDING if window is not None else FULL] * n, window
    return [FULL] * n, None  # HF Llama ignores any sliding_window key


def parse_llama(cfg: dict, arch: str) -> LlamaSpec:
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    n = cfg["num_hidden_layers"]
    head_dim = _get(cfg, "head_dim", hidden // heads)
    kv_heads = _get(cfg, "num_key_value_heads", heads)
    rope = parse_rope(cfg.get("rope_parameters") or cfg.get("rope_scaling"), cfg)
    types, window = _llama_layer_types(cfg, arch, n)
    moe = qwen3_moe_layers(cfg, n) if arch == "Qwen3MoeForCausalLM" else [None] * n
    layers = tuple(
        LayerSpec(t, head_dim, kv_heads, window if t == SLIDING else None, rope, cfg["intermediate_size"], moe=m)
        for t, m in zip(types, moe)
    )
    qwen2 = arch == "Qwen2ForCausalLM"
    attention_bias = bool(cfg.get("attention_bias", False))
    return LlamaSpec(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        num_heads=heads,
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        hidden_act=_activation(cfg, "hidden_act", default="silu"),
        qkv_bias=True if qwen2 else attention_bias,  # HF Qwen2: q/k/v always biased, o_proj never
        o_bias=False if qwen2 else attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        layers=layers,
    )


# --------------------------------------------------------------------------- Gemma 4

_GEMMA4_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_PER_LAYER_KEYS = {"head_dim", "num_key_value_heads", "intermediate_size"}


def gemma4_layer_types(cfg: dict) -> list[str]:
    n = cfg["num_hidden_layers"]
    types = list(cfg.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
    if types:
        types[-1] = FULL  # HF forces the last layer to full attention
    return types


def _gemma4_overrides(cfg: dict, types: list[str]) -> dict[int, dict[str, Any]]:
    """Per-layer overrides in the new form, converting the old global_* keys like HF does."""
    if "per_layer_config" in cfg:
        overrides = {int(k): dict(v or {}) for k, v in (cfg["per_layer_config"] or {}).items()}
        for idx, o in overrides.items():
            unknown = set(o) - _PER_LAYER_KEYS
            if unknown:
                raise ValueError(f"per_layer_config[{idx}] sets {sorted(unknown)}, which is not supported")
        return overrides
    full: dict[str, Any] = {"head_dim": _get(cfg, "global_head_dim", 512)}
    # HF gates the kv-head override on attention_k_eq_v (a Gemma4TextConfig field, default False).
    if cfg.get("attention_k_eq_v", False) and cfg.get("num_global_key_value_heads") is not None:
        full["num_key_value_heads"] = cfg["num_global_key_value_heads"]
    return {i: full for i, t in enumerate(types) if t == FULL}


def _kv_sources(types: list[str], num_shared: int) -> list[int | None]:
    """For each layer, the earlier layer whose KV it reuses (None: it owns its KV).

    HF: the last ``num_shared`` layers reuse the KV of the last non-shared layer of their type.
    """
    n = len(types)
    if num_shared <= 0:
        return [None] * n
    first_shared = n - num_shared
    last_owner = {t: i for i, t in enumerate(types[:first_shared])}
    sources: list[int | None] = [None] * first_shared
    for i in range(first_shared, n):
        if types[i] not in last_owner:
            raise ValueError(f"layer {i} ({types[i]}) shares KV but no earlier non-shared layer has that type")
        sources.append(last_owner[types[i]])
    return sources


def parse_gemma4(cfg: dict, arch: str, all_shared: bool = False) -> Gemma4Spec:
    if cfg.get("use_bidirectional_attention") == "all":
        raise ValueError("Gemma 4 with use_bidirectional_attention='all' is not supported (causal LM only)")
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    types = gemma4_layer_types(cfg)
    head_dim = _get(cfg, "head_dim", 256)
    kv_heads = _get(cfg, "num_key_value_heads", 4)
    inter = cfg["intermediate_size"]
    window = _get(cfg, "sliding_window", 512)
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    rope_params = cfg.get("rope_parameters") or _GEMMA4_DEFAULT_ROPE
    ropes = {t: parse_rope(rope_params.get(t) or _GEMMA4_DEFAULT_ROPE[t], cfg) for t in set(types)}
    overrides = _gemma4_overrides(cfg, types)
    num_shared = len(types) if all_shared else int(cfg.get("num_kv_shared_layers") or 0)
    # The assistant's layers read the target's KV: mark them shared with an out-of-model source (-1).
    sources = [-1] * len(types) if all_shared else _kv_sources(types, num_shared)
    double_wide = bool(cfg.get("use_double_wide_mlp", False))
    # HF Gemma 4: with enable_moe_block every layer has the MoE block beside its dense MLP.
    moe = parse_moe(cfg, "top_k_experts", "gemma4", True) if cfg.get("enable_moe_block") else None
    if moe is not None and all_shared:
        raise ValueError("Gemma 4 assistant: text_config.enable_moe_block is not supported")
    layers = []
    for i, t in enumerate(types):
        o = overrides.get(i, {})
        shared = sources[i] is not None
        layers.append(
            LayerSpec(
                layer_type=t,
                head_dim=o.get("head_dim", head_dim),
                num_kv_heads=o.get("num_key_value_heads", kv_heads),
                sliding_window=window if t == SLIDING else None,
                rope=ropes[t],
                # HF: use_double_wide_mlp doubles the MLP of KV-shared layers only
                intermediate_size=o.get("intermediate_size", inter) * (2 if double_wide and shared else 1),
                kv_source=sources[i],
                k_eq_v=k_eq_v and t == FULL,
                moe=moe,
            )
        )
    ple = int(_get(cfg, "hidden_size_per_layer_input", 256))  # HF default: PLE on
    return Gemma4Spec(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        num_heads=heads,
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        hidden_act=_activation(cfg, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh"),
        attention_bias=bool(cfg.get("attention_bias", False)),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=int(_get(cfg, "vocab_size_per_layer_input", 262_144)) if ple else 0,
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", True)),
        layers=tuple(layers),
    )


def parse_gemma4_multimodal(cfg: dict, arch: str) -> Gemma4Spec:
    """Gemma4ForConditionalGeneration served as text only: its text_config is the model."""
    text_cfg = cfg.get("text_config")
    if not isinstance(text_cfg, dict):
        raise ValueError(f"{arch} config has no text_config")
    spec = parse_gemma4(text_cfg, arch)
    # HF ties the head to the language model's embeddings by the top-level flag.
    return replace(spec, tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", True)))


def parse_gemma4_assistant(cfg: dict, arch: str) -> Gemma4AssistantSpec:
    text_cfg = cfg.get("text_config")
    if not isinstance(text_cfg, dict):
        raise ValueError("Gemma4AssistantForCausalLM config has no text_config")
    if int(_get(text_cfg, "hidden_size_per_layer_input", 256)):
        raise ValueError("Gemma 4 assistant text_config must have hidden_size_per_layer_input = 0")
    text = parse_gemma4(text_cfg, "Gemma4TextModel", all_shared=True)
    return Gemma4AssistantSpec(
        architecture=arch,
        text=text,
        backbone_hidden_size=int(_get(cfg, "backbone_hidden_size", 1536)),
        use_ordered_embeddings=bool(cfg.get("use_ordered_embeddings", False)),
        num_centroids=int(_get(cfg, "num_centroids", 2048)),
        centroid_intermediate_top_k=int(_get(cfg, "centroid_intermediate_top_k", 32)),
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", True)),
    )


# --------------------------------------------------------------------------- entry points

_PARSERS = {
    "LlamaForCausalLM": parse_llama,
    "MistralForCausalLM": parse_llama,
    "Qwen2ForCausalLM": parse_llama,
    "Qwen3ForCausalLM": parse_llama,
    "Qwen3MoeForCausalLM": parse_llama,
    "Gemma4ForCausalLM": parse_gemma4,
    "Gemma4ForConditionalGeneration": parse_gemma4_multimodal,
    "Gemma4AssistantForCausalLM": parse_gemma4_assistant,
}


def architecture_of(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry")
    return archs[0]


def parse_config(cfg: dict) -> ModelSpec:
    arch = architecture_of(cfg)
    parser = _PARSERS.get(arch)
    if parser is None:
        raise ValueError(f"architecture {arch!r} is not supported (supported: {', '.join(sorted(_PARSERS))})")
    return parser(cfg, arch)


def load_config(model_dir: str | Path) -> dict:
    with open(Path(model_dir) / "config.json") as f:
        return json.load(f)
