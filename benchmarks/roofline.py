"""Bytes a decode step must move, from a model's shapes alone (no weights loaded).

    weights read  = every parameter, except an untied input-embedding table (a step reads only
                    its rows; a tied table is read whole by the LM head)
    KV read       = for each row, every layer's keys+values over its context (sliding layers:
                    at most the window), written KV is counted once too
    step floor    = (weights read + KV read) / copy bandwidth  (HBM, measured in the same run)

``all_weight_bytes`` (every parameter) is the looser figure the issue's 266 tok/s quotes.
Mixture-of-experts models (``moe_shapes``, ``moe_step_bytes``) count, of their experts, only
the union a step selected (measured on the device: ``benchmarks/moe_bench.py``).
With ``quantization="fp8"`` the projections count one byte an element plus their scales (the
engine's online FP8 layout), and ``kv_dtype_bytes=1`` counts an FP8 KV cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu_worker.models import model_class  # noqa: E402
from gpu_worker.models.config import architecture_of, load_config, parse_config  # noqa: E402
from gpu_worker.quant import prepare_quant, resolve_format  # noqa: E402


SCALE_BUFFERS = ("weight_scale", "gate_up_scale", "down_scale")  # FP8 scales (float32), projections and experts


def meta_model(model_dir: str, quantization: str | None = None):
    """(spec, the model on the meta device as the engine builds it: FP8 where it would be)."""
    cfg = load_config(model_dir)
    spec = parse_config(cfg)
    with torch.device("meta"):
        model = model_class(architecture_of(cfg))(spec)
    if quantization is not None:  # the engine's FP8 projections and experts, on the meta model
        prepare_quant(model, resolve_format(cfg, quantization), set())
    return spec, model


def _weight_bytes(t: torch.Tensor, dtype_bytes: int) -> int:
    """A weight's bytes in the engine: e4m3 or the model dtype (the meta model is not cast)."""
    return t.numel() * (1 if t.dtype == torch.float8_e4m3fn else dtype_bytes)


def model_shapes(model_dir: str, dtype_bytes: int = 2, quantization: str | None = None,
                 kv_dtype_bytes: int | None = None) -> dict:
    spec, model = meta_model(model_dir, quantization)
    nbytes = sum(_weight_bytes(p, dtype_bytes) for p in model.parameters())
    nbytes += sum(4 * b.numel() for n, b in model.named_buffers() if n.endswith(SCALE_BUFFERS))
    total = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    read = nbytes - (embed * dtype_bytes if not model.tie_word_embeddings else 0)
    kvb = kv_dtype_bytes or dtype_bytes
    layers = []  # (kv bytes per token, window or None) per physical KV layer
    for i, shape in enumerate(model.kv_shapes):
        window = _window_of(spec, model, i)
        layers.append((shape.num_kv_heads * (shape.head_dim + shape.v_dim) * kvb, window))
    return {"params": total, "all_weight_bytes": nbytes, "weight_bytes_read": read, "kv_layers": layers}


def _window_of(spec, model, pool_layer: int):
    for i, layer in enumerate(spec.layers):
        phys = model.physical_kv_layer(i) if hasattr(model, "physical_kv_layer") else i
        if phys == pool_layer:
            return layer.sliding_window
    return None


def kv_bytes(shapes: dict, contexts: list[int]) -> int:
    return sum(bpt * (min(c, w) if w else c) for c in contexts for bpt, w in shapes["kv_layers"])


def step_floor_s(shapes: dict, contexts: list[int], bandwidth: float, strict: bool = True) -> float:
    w = shapes["weight_bytes_read"] if strict else shapes["all_weight_bytes"]
    return (w + kv_bytes(shapes, contexts)) / bandwidth


def decode_ceiling_tok_s(shapes: dict, batch: int, input_len: int, output_len: int, bandwidth: float,
                         strict: bool = True) -> float:
    """Output tok/s of a bandwidth-bound decode of ``batch`` rows from input_len to
    input_len + output_len (prefill not counted: it is compute, and short here)."""
    total = sum(step_floor_s(shapes, [input_len + k] * batch, bandwidth, strict) for k in range(output_len))
    return batch * output_len / total


def decode_phase_ceiling_tok_s(shapes: dict, w: dict, bandwidth: float, rows: int | None = None) -> float | None:
    """The step roofline of a measured decode phase (offline.py's ``decode_*`` figures): each
    decode step reads the weights once plus its rows' KV (context summed over rows) and emits
    ``decode_tokens_per_step`` tokens. A sliding-window layer reads at most its window a row,
    which needs the row count (``rows``, e.g. 1 for a one-request run; rows at the mean
    context, exact when they are equal): without it such a model gets None."""
    windowed = any(win for _, win in shapes["kv_layers"])
    if not w.get("decode_steps") or (windowed and not rows):
        return None
    ctx = w["decode_ctx_tokens_per_step"]
    kv = sum(bpt * (min(ctx, win * rows) if win else ctx) for bpt, win in shapes["kv_layers"])
    return w["decode_tokens_per_step"] * bandwidth / (shapes["weight_bytes_read"] + kv)


def moe_shapes(model_dir: str, dtype_bytes: int = 2, quantization: str | None = None) -> dict:
    """``model_shapes`` split for a mixture-of-experts model: ``fixed_bytes`` is what every decode
    step reads whatever it routes (attention, dense MLPs, routers, norms, the LM head; an untied
    input table not), ``expert_bytes`` one expert's weights in each MoE layer (gate, up, down),
    in layer order (FP8 experts: e4m3 plus their float32 scales). A step then reads ``fixed_bytes +
    sum(union_l * expert_bytes[l])``, union_l the experts its tokens selected in layer l."""
    from gpu_worker.models.moe import Experts

    shapes = model_shapes(model_dir, dtype_bytes, quantization)
    model = meta_model(model_dir, quantization)[1]
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    per = [_weight_bytes(m.gate_up_proj[0], dtype_bytes) + _weight_bytes(m.down_proj[0], dtype_bytes)
           + (4 * (m.gate_up_scale[0].numel() + m.down_scale[0].numel()) if m.quant is not None else 0)
           for m in experts]
    total = sum(p * m.num_experts for p, m in zip(per, experts))
    return {**shapes, "fixed_bytes": shapes["weight_bytes_read"] - total, "expert_bytes": per,
            "num_experts": experts[0].num_experts if experts else 0}


def moe_step_bytes(shapes: dict, unions: list[float], ctx_tokens: float, rows: int) -> dict:
    """The bytes one decode step must read: fixed weights, the union of selected experts per MoE
    layer (``unions``, measured), the KV of ``rows`` rows with ``ctx_tokens`` keys in all (a
    sliding layer at most its window a row)."""
    kv = sum(bpt * (min(ctx_tokens, win * rows) if win else ctx_tokens) for bpt, win in shapes["kv_layers"])
    experts = sum(u * b for u, b in zip(unions, shapes["expert_bytes"]))
    return {"fixed": shapes["fixed_bytes"], "experts": experts, "kv": kv, "total": shapes["fixed_bytes"] + experts + kv}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("model_path")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--bandwidth", type=float, default=4.27e12)
    a = ap.parse_args()
    s = model_shapes(a.model_path)
    print(json.dumps({"params": s["params"], "all_weight_bytes": s["all_weight_bytes"],
                      "weight_bytes_read": s["weight_bytes_read"],
                      "ceiling_tok_s": decode_ceiling_tok_s(s, a.batch, a.input_len, a.output_len, a.bandwidth),
                      "ceiling_tok_s_all_weights": decode_ceiling_tok_s(s, a.batch, a.input_len, a.output_len,
                                                                        a.bandwidth, strict=False)}, indent=2))
