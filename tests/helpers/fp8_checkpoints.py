"""FP8 checkpoints made in the tests from the tiny random HF checkpoints (checkpoints.py).

``quantize_checkpoint(src, out, layout)`` writes ``out``: the same model with its decoder
projections stored as float8 e4m3 plus scales, in one of the layouts users meet, and a
``quantization_config`` saying so; ``out/dequantized`` holds the same model with those weights
dequantized back to float32 (what HF, the oracle, runs).

Layouts: ``block`` (``quant_method: fp8``, 128 x 128 ``weight_scale_inv``, dynamic activations),
``ct-tensor`` / ``ct-channel`` / ``ct-block`` (compressed-tensors ``weight_scale`` per tensor /
per output channel / per block) with ``acts`` none (weight-only), dynamic or static
(``input_scale`` per projection). MoE experts are quantized in the layout ``src`` stores them:
per-expert modules as any projection, HF's fused 3-D ``experts.gate_up_proj`` / ``down_proj``
expert by expert with the stacked scales in ``experts.gate_up_proj_scale_inv`` (HF's names).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

from gpu_worker.quant.fp8_math import BLOCK, FP8_MAX, dequantize, to_fp8

# decoder projections, per-expert MoE weights (``mlp.experts.N.gate_proj.weight``, the layout FP8
# MoE checkpoints ship), and Gemma's per-layer projections (the engine dequantizes those at
# load); never embeddings, heads, norms, routers or the assistant's centroids
PROJ = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.(experts\.\d+\.)?\w+_proj\.weight$"
                  r"|per_layer_(input_gate|projection)\.weight$")
FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
STATIC_INPUT_SCALE = 16.0 / FP8_MAX  # activations up to 16 keep their range


def _quantize(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 weight, the checkpoint's scale tensor for ``strategy``)."""
    w = w.float()
    n, k = w.shape
    if strategy == "tensor":
        s = (w.abs().max().clamp_min(1e-12) / FP8_MAX).reshape(1)
        return to_fp8(w / s), s
    if strategy == "channel":
        s = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX
        return to_fp8(w / s), s
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    pad = torch.nn.functional.pad(w, (0, kb * BLOCK - k, 0, nb * BLOCK - n))
    s = pad.view(nb, BLOCK, kb, BLOCK).abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX
    full = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    return to_fp8(w / full), s


def _dequantized(w8: torch.Tensor, s: torch.Tensor, strategy: str, dtype: torch.dtype) -> torch.Tensor:
    if strategy == "block":
        return dequantize(w8, s, BLOCK).to(dtype)
    return dequantize(w8, s.reshape(-1, 1).expand(w8.shape[0], 1)).to(dtype)


def _quantize_fused(t: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused experts [E, N, K] -> (e4m3, scales stacked per expert, the dequantized twin)."""
    qs = [_quantize(w, strategy) for w in t]
    w8, s = torch.stack([q[0] for q in qs]), torch.stack([q[1] for q in qs])
    return w8, s, torch.stack([_dequantized(w, c, strategy, t.dtype) for w, c in zip(w8, s)])


def _config(layout: str, acts: str, kv: bool) -> dict:
    if layout == "block":
        assert acts == "dynamic", "block FP8 checkpoints quantize activations dynamically"
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK]}
    strategy = layout.removeprefix("ct-")
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}
    if strategy == "block":
        weights["block_structure"] = [BLOCK, BLOCK]
    group = {"targets": ["Linear"], "weights": weights}
    if acts != "none":
        group["input_activations"] = {"num_bits": 8, "type": "float", "symmetric": True,
                                      "strategy": "token" if acts == "dynamic" else "tensor",
                                      "dynamic": acts == "dynamic"}
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": group}, "ignore": ["lm_head"]}
    if kv:
        qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                 "symmetric": True}
    return qc


def quantize_checkpoint(src: str, out: str, layout: str = "block", acts: str = "dynamic",
                        kv_scales: dict[int, tuple[float, float]] | None = None) -> str:
    """The FP8 checkpoint of ``src`` in ``out`` (``kv_scales``: layer -> (k, v) scales written as
    ``model.layers.N.self_attn.{k,v}_scale``); its float32 twin in ``out/dequantized``."""
    os.makedirs(out, exist_ok=True)
    deq_dir = os.path.join(out, "dequantized")
    weights = [f for f in os.listdir(src) if f.endswith(".safetensors") or f == "model.safetensors.index.json"]
    for d in (out, deq_dir):
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(src):
            if f not in weights and os.path.isfile(os.path.join(src, f)):
                shutil.copy(os.path.join(src, f), d)
    strategy = "block" if layout == "block" else layout.removeprefix("ct-")
    tensors = {}  # every shard of ``src``; written back as one file
    for f in sorted(w for w in weights if w.endswith(".safetensors")):
        tensors.update(load_file(os.path.join(src, f)))
    quant, deq = {}, {}
    for name, t in tensors.items():
        if FUSED_EXPERTS.search(name):
            quant[name], quant[f"{name}_scale_inv"], deq[name] = _quantize_fused(t, strategy)
            if acts == "static":
                quant[f"{name}_activation_scale"] = torch.full((t.shape[0],), STATIC_INPUT_SCALE)
            continue
        if not PROJ.search(name):
            quant[name] = deq[name] = t
            continue
        w8, s = _quantize(t, strategy)
        deq[name] = _dequantized(w8, s, strategy, t.dtype)
        quant[name] = w8
        base = name.removesuffix(".weight")
        quant[f"{base}.weight_scale_inv" if layout == "block" else f"{base}.weight_scale"] = s
        if acts == "static":
            quant[f"{base}.input_scale"] = torch.tensor([STATIC_INPUT_SCALE])
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in tensors) else "model."
    for layer, (k, v) in (kv_scales or {}).items():
        quant[f"{prefix}layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        quant[f"{prefix}layers.{layer}.self_attn.v_scale"] = torch.tensor(v)
    save_file(quant, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    save_file(deq, os.path.join(deq_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = _config(layout, acts, kv_scales is not None)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return out


def dequantized(out: str) -> str:
    return os.path.join(out, "dequantized")
