"""Quantizing a model's projections before its weights are read, and reading FP8 tensors into them.

``prepare`` runs on the meta model, after its cast to the model dtype and before it is
allocated: it decides which projections and MoE experts are FP8 and makes them so
(``Fp8LinearMethod.create``, ``Fp8ExpertsMethod.create``). In a checkpoint format, a
projection is FP8 where the checkpoint stores its weight (every part of a merged one) in
float8, so a format's ignore list needs no parsing, and a MoE layer's experts where it stores
any of them in float8; online, every quantizable projection and all experts are. The returned
``QuantLoad`` then takes the checkpoint tensors those modules own (weights, scales, input
scales; the experts' through ``ExpertsLoad``), quantizes unquantized weights under online FP8,
dequantizes float8 weights of modules that stay unquantized (a plain ``nn.Linear`` such as
Gemma's per-layer projections) into the model dtype, and keeps the checkpoint's per-layer k / v
scales for an FP8 KV cache.
"""

from __future__ import annotations

import logging

import torch
from safetensors import safe_open

from gpu_worker.quant.config import Fp8Format
from gpu_worker.quant.fp8 import Fp8LinearMethod
from gpu_worker.quant.fp8_experts import FUSED, SCALE_LEAVES, ExpertsLoad, Fp8ExpertsMethod
from gpu_worker.quant.fp8_math import BLOCK, FP8, dequantize, per_row_scale

log = logging.getLogger("tandem.worker")

KV_SCALE_LEAVES = ("k_scale", "v_scale")
FUSED_LEAVES = tuple(f".{leaf}" for leaf in FUSED)


def fp8_weight_names(model, files) -> set[str]:
    """Our names of the checkpoint's float8 weights: ``*.weight`` and fused experts'
    ``*.gate_up_proj`` / ``*.down_proj`` (from the file headers only)."""
    out = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith((".weight", *FUSED_LEAVES)) and f.get_slice(key).get_dtype() == "F8_E4M3":
                    name = model.checkpoint_key(key)
                    if name is not None:
                        out.add(name)
    return out


def _checkpoint_parts(path: str, mod) -> dict[str, str | None]:
    """Checkpoint module path of each part of ``mod`` -> the part (None: not merged)."""
    parts = getattr(mod, "parts", None)
    if parts is None:
        return {path: None}
    parent = path.rpartition(".")[0]
    return {f"{parent}.{p}": p for p in parts}


def prepare(model, fmt: Fp8Format | None, fp8_names: set[str]) -> "QuantLoad":
    """Make the FP8 projections FP8 (on the meta model) and return what loads into them."""
    if fmt is None and fp8_names:
        raise ValueError(f"the checkpoint stores float8 weights (e.g. {sorted(fp8_names)[0]}) but config.json "
                         f"has no quantization_config: their scales cannot be read")
    chosen, experts = {}, {}
    if fmt is not None:
        for path, mod in model.named_modules():
            if not getattr(mod, "quantizable", False):
                continue
            flags = [f"{p}.weight" in fp8_names for p in _checkpoint_parts(path, mod)]
            if fmt.online or all(flags):
                chosen[path] = mod
            elif any(flags):
                raise ValueError(f"{path}: the checkpoint stores some of its merged parts in float8 and some not")
        experts = {path: mod for path, mod in model.named_modules() if getattr(mod, "quantizable_experts", False)
                   and (fmt.online or any(n.startswith(f"{path}.") for n in fp8_names))}
        if not fmt.online and not fp8_names:
            raise ValueError(f"quantization_config ({fmt.source}) but the checkpoint has no float8 weights")
        method, expert_method = Fp8LinearMethod(fmt), Fp8ExpertsMethod(fmt)
        for mod in chosen.values():
            method.create(mod)
        for mod in experts.values():
            expert_method.create(mod)
        log.info("%s: %d projections, the experts of %d MoE layers", fmt.describe(), len(chosen), len(experts))
    return QuantLoad(model, fmt, chosen, fp8_names, experts)


def _full_rows(mod, part: str | None) -> int:
    """Rows of the checkpoint tensor a part is cut from (tensor parallelism), or its own rows."""
    if part is not None and hasattr(mod, "ranges"):
        return mod.ranges[part].full
    if hasattr(mod, "rows"):
        return mod.rows.full
    return mod.shard(part)[1] if part is not None else mod.weight.shape[0]


class QuantLoad:
    def __init__(self, model, fmt: Fp8Format | None, modules: dict, fp8_names: set[str], experts: dict):
        self.model, self.fmt, self.modules, self.fp8_names = model, fmt, modules, fp8_names
        self.experts = ExpertsLoad(experts, fmt is not None and fmt.online)
        self.parts = {ck: (path, part) for path, mod in modules.items()
                      for ck, part in _checkpoint_parts(path, mod).items()}
        self.seen: set[tuple[str, str]] = set()
        self.input_seen: set[str] = set()
        self.pending: dict[str, torch.Tensor] = {}  # float8 weights of unquantized modules and their scales
        self.kv: dict[str, dict[str, float]] = {}  # attention module -> {"k_scale": s, "v_scale": s}

    def owns(self, name: str) -> bool:
        """Whether checkpoint name ``name`` is a quantized projection's weight (``finish`` says
        whether it came)."""
        module, _, leaf = name.rpartition(".")
        return (module in self.parts and leaf == "weight") or self.experts.owns(name)

    def take(self, name: str, get, put) -> bool:
        """Load checkpoint tensor ``name`` (``get()`` reads it) if it is ours; ``put(name, t)``
        hands a dequantized tensor to the plain path. False: the plain path loads it."""
        if self.experts.take(name, get):
            return True
        module, _, leaf = name.rpartition(".")
        hit = self.parts.get(module)
        if hit is not None and leaf in ("weight", "input_scale", *SCALE_LEAVES):
            self._load(hit, name, leaf, get())
            self.seen.add((module, "weight_scale" if leaf in SCALE_LEAVES else leaf))
            return True
        if leaf in KV_SCALE_LEAVES:
            self.kv.setdefault(module, {})[leaf] = float(get().float().reshape(-1).max())
            return True
        if name in self.fp8_names or (leaf in SCALE_LEAVES and f"{module}.weight" in self.fp8_names):
            self.pending[name] = get()
            self._dequantize_ready(module, put)
            return True
        return leaf == "input_scale" and f"{module}.weight" in self.fp8_names  # an input scale for a plain module

    def _dequantize_ready(self, module: str, put) -> None:
        w = self.pending.get(f"{module}.weight")
        s = next((self.pending[f"{module}.{leaf}"] for leaf in SCALE_LEAVES if f"{module}.{leaf}" in self.pending), None)
        if w is None or s is None:
            return
        put(f"{module}.weight", dequantize(w, per_row_scale(s, w.shape[0], w.shape[1])))
        for key in [k for k in self.pending if k.rpartition(".")[0] == module]:
            del self.pending[key]

    def _load(self, hit: tuple[str, str | None], name: str, leaf: str, src: torch.Tensor) -> None:
        path, part = hit
        mod = self.modules[path]
        off, rows = mod.shard(part) if part is not None else (0, mod.weight.shape[0])
        with torch.no_grad():
            if leaf == "input_scale":  # merged parts share their input: the largest scale (allocated empty)
                value = src.float().reshape(-1).max().reshape(1).to(mod.input_scale.device)
                first = path not in self.input_seen
                self.input_seen.add(path)
                mod.input_scale.copy_(value if first else torch.maximum(mod.input_scale, value))
                return
            if leaf == "weight":
                src = _cut(mod, part, src)
                if src.dtype != FP8:
                    if not self.fmt.online:
                        raise ValueError(f"{name}: expected float8 weights, the checkpoint has {src.dtype}")
                    _check(name, src, (rows, mod.weight.shape[1]))
                    mod.quant.quantize_into(mod, slice(off, off + rows), src)
                    return
                _check(name, src, (rows, mod.weight.shape[1]))
                mod.weight.narrow(0, off, rows).copy_(src.to(mod.weight.device))
                return
            s = per_row_scale(src, _full_rows(mod, part), _full_cols(mod))
            s = _cut_scale(mod, part, s, name)
            _check(name, s, (rows, mod.weight_scale.shape[1]))
            mod.weight_scale.narrow(0, off, rows).copy_(s.to(mod.weight_scale.device))

    def init_dummy(self, seed: int = 0) -> None:
        gens: dict = {}
        for mod in self.modules.values():
            dev = mod.weight.device
            gen = gens.setdefault(dev, torch.Generator(device=dev).manual_seed(seed + 1))
            mod.quant.init_dummy(mod, gen)
            mod.quant.finish(mod)
        for mod in self.experts.modules.values():
            gen = gens.setdefault(mod.gate_up_proj.device,
                                  torch.Generator(device=mod.gate_up_proj.device).manual_seed(seed + 1))
            mod.quant.init_dummy(mod, gen)
            mod.quant.finish(mod)

    def finish(self) -> list[str]:
        """After the last tensor: each projection's layout settled; returns the checkpoint names
        that were needed and never came."""
        missing = [f"{ck}.weight" for ck in self.parts if (ck, "weight") not in self.seen]
        if self.fmt is not None and not self.fmt.online:
            missing += [f"{ck}.weight_scale" for ck in self.parts if (ck, "weight_scale") not in self.seen]
        if self.fmt is not None and self.fmt.acts == "static":
            missing += [f"{ck}.input_scale" for ck in self.parts if (ck, "input_scale") not in self.seen]
        missing += self.experts.missing(need_scales=self.fmt is not None and not self.fmt.online)
        stray = [k for k in self.pending if k.endswith(".weight")]
        if stray:
            raise ValueError(f"{stray[0]}: float8 weight without a weight_scale / weight_scale_inv")
        for mod in [*self.modules.values(), *self.experts.modules.values()]:
            mod.quant.finish(mod)
        return missing

    def kv_scales(self) -> dict[int, tuple[float, float]]:
        """Pool layer -> (k scale, v scale) from the checkpoint (layers that write KV only)."""
        out = {}
        for module, s in self.kv.items():
            attn = getattr(self.model.get_submodule(module), "attn", None)
            if attn is not None and attn.writes_kv:
                out[attn.kv_layer] = (s.get("k_scale", 1.0), s.get("v_scale", 1.0))
        return out


def _full_cols(mod) -> int:
    cols = getattr(mod, "cols", None)
    return cols.full if cols is not None else mod.weight.shape[1]


def _cut(mod, part: str | None, src: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a checkpoint weight (the module's own cut; whole at TP=1)."""
    cut = getattr(mod, "checkpoint_shard", None)
    return src if cut is None else cut("weight", src, part)


def _cut_scale(mod, part: str | None, s: torch.Tensor, name: str) -> torch.Tensor:
    """This rank's rows (column-parallel) or 128-column groups (row-parallel) of per-row scales."""
    cols = getattr(mod, "cols", None)
    if cols is None:
        return _cut(mod, part, s)
    if s.shape[1] == 1:
        return s
    if cols.start % BLOCK or cols.size % BLOCK:
        raise ValueError(f"{name}: --tp-size splits the input features at {cols.start}, not a multiple of {BLOCK}")
    return s[:, cols.start // BLOCK: (cols.start + cols.size) // BLOCK]


def _check(name: str, t: torch.Tensor, shape: tuple[int, int]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model shape {tuple(shape)}")
