"""The mixture-of-experts part of a config (``models/config.py`` parses the rest): which layers
have a MoE block and its shape, from HF's fields, each error naming the field it cannot serve."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoESpec:
    """A sparse mixture-of-experts block: ``num_experts`` gated MLPs of width
    ``intermediate_size``, ``top_k`` of them per token, weighted by the router.

    ``router``: ``"softmax"`` (Qwen3-MoE: softmax over the logits of the layer's input, top-k,
    renormalised when ``renormalize``, weights rounded to the model dtype) or ``"gemma4"``
    (Gemma 4: the logits of a weightless RMS norm of the residual stream times a learned scale
    and 1/sqrt(hidden), softmax, top-k, always renormalised, then times a learned per-expert
    scale; the weights stay float32)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    router: str
    renormalize: bool


def _positive(cfg: dict, key: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"MoE config: {key} must be a positive integer, got {value!r}")
    return value


def _experts_key(cfg: dict) -> str:
    """HF's Qwen3-MoE config stores ``num_experts`` as ``num_local_experts`` (an attribute map)
    from transformers 5 on; checkpoints written before say ``num_experts``."""
    return "num_local_experts" if cfg.get("num_experts") is None and "num_local_experts" in cfg else "num_experts"


def parse_moe(cfg: dict, top_k_key: str, router: str, renormalize: bool) -> MoESpec:
    """The MoE fields shared by every supported family; each error names its config field."""
    scoring = cfg.get("scoring_func", "softmax")
    if scoring != "softmax":
        raise ValueError(f"MoE config: scoring_func {scoring!r} is not supported (softmax only)")
    for key in ("n_shared_experts", "num_shared_experts", "shared_expert_intermediate_size", "n_group",
                "topk_group"):
        if cfg.get(key):
            raise ValueError(f"MoE config: {key} = {cfg[key]!r} is not supported (no shared or grouped experts)")
    experts, top_k = _positive(cfg, _experts_key(cfg)), _positive(cfg, top_k_key)
    if top_k > experts:
        raise ValueError(f"MoE config: {top_k_key} ({top_k}) is larger than {_experts_key(cfg)} ({experts})")
    return MoESpec(experts, top_k, _positive(cfg, "moe_intermediate_size"), router, renormalize)


def qwen3_moe_layers(cfg: dict, n: int) -> list[MoESpec | None]:
    """HF Qwen3-MoE: layer i is sparse unless it is in ``mlp_only_layers`` or (i + 1) is not a
    multiple of ``decoder_sparse_step``; no experts at all (num_experts 0) means all dense."""
    if not cfg.get(_experts_key(cfg)):
        return [None] * n
    step = 1 if cfg.get("decoder_sparse_step") is None else cfg["decoder_sparse_step"]
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        raise ValueError(f"MoE config: decoder_sparse_step must be a positive integer, got {step!r}")
    dense_only = set(cfg.get("mlp_only_layers") or [])
    moe = parse_moe(cfg, "num_experts_per_tok", "softmax", bool(cfg.get("norm_topk_prob", False)))
    return [None if i in dense_only or (i + 1) % step else moe for i in range(n)]
