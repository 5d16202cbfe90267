"""What a checkpoint's ``quantization_config`` and ``--quantization`` ask for: one ``Fp8Format``,
or None for an unquantized model.

Two checkpoint layouts are served, both float8 e4m3 weights with float32 scales:

- block FP8 (``quant_method: "fp8"``, HF's FineGrainedFP8, DeepSeek and Qwen FP8 releases):
  ``weight_block_size`` [128, 128] and ``weight_scale_inv`` (the multiplier, despite its name)
  per 128 x 128 tile; without a block size (vLLM's older per-tensor form) ``weight_scale`` per
  tensor and, for ``activation_scheme: static``, ``input_scale``;
- compressed-tensors FP8 (``quant_method: "compressed-tensors"``, llm-compressor): ``weight_scale``
  per tensor, per output channel or per 128 x 128 block, activations dynamic (computed at run
  time) or static (``input_scale``), or absent (weight-only).

A format the engine cannot compute exactly is refused here, with one line naming it: loading
float8 values without their scales would serve wrong tokens without a word.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.kernels.fp8_round import BLOCK  # the one block size the kernels take (a K tile a scale group)
QUANTIZATION_METHODS = ("fp8", "compressed-tensors")  # --quantization's values (common/args.py keeps a copy)

# weights: "channel" = one scale per output row (per-tensor scales are expanded to it);
#          "block" = one scale per 128 columns of each row (a 128 x 128 tile's scale, per row).
# acts:    "none" = weight-only (activations stay in the model dtype);
#          "dynamic" = per token and 128-column group, computed from the activations at run time;
#          "static" = one calibrated scale per projection (the checkpoint's input_scale).
WEIGHT_LAYOUTS = ("channel", "block")
ACT_SCHEMES = ("none", "dynamic", "static")


@dataclass(frozen=True)
class Fp8Format:
    source: str  # "fp8" | "compressed-tensors" (the checkpoint's) | "online" (quantized at load)
    weights: str  # one of WEIGHT_LAYOUTS
    acts: str  # one of ACT_SCHEMES
    kv_scales: bool = False  # the checkpoint carries per-layer k / v scales for an FP8 KV cache

    def __post_init__(self):
        assert self.weights in WEIGHT_LAYOUTS and self.acts in ACT_SCHEMES, self

    @property
    def online(self) -> bool:
        return self.source == "online"

    def describe(self) -> str:
        weights = "128x128 blocks" if self.weights == "block" else "per output channel"
        acts = {"none": "weight-only", "dynamic": "dynamic activation scales",
                "static": "static activation scales"}[self.acts]
        origin = "quantized at load" if self.online else f"{self.source} checkpoint"
        return f"FP8 e4m3 weights ({weights}, {acts}; {origin})"


ONLINE = Fp8Format("online", "channel", "dynamic")


def quantization_config(cfg: dict) -> dict | None:
    """The checkpoint's ``quantization_config`` (top level, or a multimodal wrapper's text part)."""
    qc = cfg.get("quantization_config")
    if qc is None and isinstance(cfg.get("text_config"), dict):
        qc = cfg["text_config"].get("quantization_config")
    return qc


def parse_checkpoint_format(cfg: dict) -> Fp8Format | None:
    """The checkpoint's FP8 format, None when it is not quantized; ValueError (one line naming
    the method or field) for anything else."""
    qc = quantization_config(cfg)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config: expected an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _block_fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ValueError(f"quantization_config: quant_method {method!r} is not supported "
                     f"(Tandem serves FP8 e4m3: 'fp8' and 'compressed-tensors' float8 checkpoints)")


def _block_fp8(qc: dict) -> Fp8Format:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config (fp8): fmt {fmt!r} is not supported (e4m3)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config (fp8): activation_scheme {scheme!r} is not supported (dynamic, static)")
    block = qc.get("weight_block_size")
    if block is None:  # vLLM's per-tensor form: weight_scale per tensor, input_scale if static
        return Fp8Format("fp8", "channel", scheme)
    if list(block) != [BLOCK, BLOCK]:
        raise ValueError(f"quantization_config (fp8): weight_block_size {list(block)} is not supported "
                         f"([{BLOCK}, {BLOCK}])")
    if scheme != "dynamic":
        raise ValueError("quantization_config (fp8): block weights need activation_scheme 'dynamic'")
    return Fp8Format("fp8", "block", "dynamic")


def _compressed_tensors(qc: dict) -> Fp8Format:
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config (compressed-tensors): no config_groups")
    schemes = {_ct_scheme(name, g) for name, g in groups.items()}
    if len(schemes) > 1:
        raise ValueError(f"quantization_config (compressed-tensors): groups use different schemes "
                         f"{sorted(schemes)}; one FP8 scheme for every target is supported")
    weights, acts = schemes.pop()
    kv = qc.get("kv_cache_scheme")
    if kv is not None and not (kv.get("num_bits") == 8 and kv.get("type") == "float"
                               and kv.get("strategy", "tensor") == "tensor"):
        raise ValueError(f"quantization_config (compressed-tensors): kv_cache_scheme {kv} is not supported "
                         f"(8-bit float, per tensor)")
    return Fp8Format("compressed-tensors", weights, acts, kv_scales=kv is not None)


def _ct_scheme(name: str, group: dict) -> tuple[str, str]:
    """(weights, acts) of one compressed-tensors config group."""
    w = group.get("weights") or {}
    where = f"quantization_config (compressed-tensors) group {name!r}"
    if w.get("num_bits") != 8 or w.get("type") != "float":
        raise ValueError(f"{where}: weights of {w.get('num_bits')}-bit {w.get('type')} are not supported "
                         f"(8-bit float)")
    if w.get("dynamic"):
        raise ValueError(f"{where}: dynamic weight scales are not supported")
    strategy = w.get("strategy", "tensor")
    if strategy in ("tensor", "channel"):
        weights = "channel"
    elif strategy == "block" and list(w.get("block_structure") or []) == [BLOCK, BLOCK]:
        weights = "block"
    else:
        raise ValueError(f"{where}: weight strategy {strategy!r} is not supported "
                         f"(tensor, channel, block {BLOCK}x{BLOCK})")
    a = group.get("input_activations")
    if a is None:
        return weights, "none"
    if a.get("num_bits") != 8 or a.get("type") != "float":
        raise ValueError(f"{where}: activations of {a.get('num_bits')}-bit {a.get('type')} are not supported "
                         f"(8-bit float)")
    if a.get("dynamic"):
        return weights, "dynamic"
    if a.get("strategy", "tensor") != "tensor":
        raise ValueError(f"{where}: static activation strategy {a.get('strategy')!r} is not supported (tensor)")
    return weights, "static"


def resolve_format(cfg: dict, quantization: str | None) -> Fp8Format | None:
    """The format a model is served in: the checkpoint's, or online FP8 for an unquantized
    checkpoint under ``--quantization fp8``."""
    found = parse_checkpoint_format(cfg)
    if quantization is None:
        return found
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"--quantization: {quantization!r} is not supported ({', '.join(QUANTIZATION_METHODS)})")
    if quantization == "compressed-tensors":
        if found is None or found.source != "compressed-tensors":
            raise ValueError("--quantization compressed-tensors: the checkpoint has no compressed-tensors "
                             "quantization_config")
        return found
    return found if found is not None else ONLINE
