"""FP8 experts: a MoE layer's ``Experts`` holding e4m3 expert weights, and loading them.

``Fp8ExpertsMethod.create`` (on the meta model) turns ``gate_up_proj`` [E, 2i, H] and
``down_proj`` [E, H, i] into e4m3 and adds float32 ``gate_up_scale`` [E, ceil(2i / scale_rows),
KB] and ``down_scale`` [E, ceil(H / scale_rows), KB'] (``fp8_math``'s layout per expert: KB is 1,
one scale per output channel, or one per 128 columns). ``scale_rows`` is 1 while loading and 128
after ``finish`` where every 128-row group of a block layout shares its scales. The grouped
kernel (``kernels/moe_gemm.py``) dequantizes each weight tile in registers into the model dtype,
the decode kernel (``moe_decode.py``) applies the scales to its float32 sums, and the CPU twin
dequantizes the experts a step hits. Expert activations are not quantized: a checkpoint's
activation scheme (dynamic, or static input scales) applies to its dense projections only, and
expert input scales are read and dropped.

Checkpoint layouts: per-expert modules (``experts.N.{gate,up,down}_proj.weight`` with
``weight_scale`` or ``weight_scale_inv``, as the Hub's FP8 MoE releases and llm-compressor ship
them) and HF's fused tensors (``experts.gate_up_proj`` with ``experts.gate_up_proj_scale_inv``,
likewise ``down_proj``). Under ``--quantization fp8`` a bf16 checkpoint's experts, in either
layout, are quantized per output channel as they load. Every tensor is cut to this rank's slice
of the intermediate dimension before it is stored (``Experts.checkpoint_shard``).
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.kernels.moe import ExpertScales
from gpu_worker.quant.config import Fp8Format
from gpu_worker.quant.fp8_math import BLOCK, FP8, dequantize, per_row_scale, quantize_rows

PROJS = ("gate_proj", "up_proj", "down_proj")
FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
SCALE_LEAVES = ("weight_scale", "weight_scale_inv")  # a weight's scale, as checkpoints name it (load.py too)
INPUT_SCALE_LEAVES = ("input_scale", "gate_up_proj_activation_scale", "down_proj_activation_scale")


class Fp8ExpertsMethod:
    def __init__(self, fmt: Fp8Format):
        self.fmt = fmt

    def create(self, mod: nn.Module) -> None:
        e, n2, h = mod.gate_up_proj.shape
        i = mod.down_proj.shape[2]
        dev = mod.gate_up_proj.device
        mod.gate_up_proj = nn.Parameter(torch.empty(e, n2, h, dtype=FP8, device=dev), requires_grad=False)
        mod.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=FP8, device=dev), requires_grad=False)
        block = self.fmt.weights == "block"
        for name, rows, cols in (("gate_up_scale", n2, h), ("down_scale", h, i)):
            kb = -(-cols // BLOCK) if block else 1
            mod.register_buffer(name, torch.empty(e, rows, kb, dtype=torch.float32, device=dev), persistent=False)
        mod.scale_rows = 1
        mod.quant = self

    def finish(self, mod: nn.Module) -> None:
        """After loading: scales shared by each 128-row group kept once per group (both passes
        or neither: the kernels take one ``scale_rows``)."""
        if self.fmt.weights != "block" or mod.scale_rows != 1:
            return
        grouped = [_grouped(mod.gate_up_scale), _grouped(mod.down_scale)]
        if all(g is not None for g in grouped):
            mod.gate_up_scale, mod.down_scale = grouped
            mod.scale_rows = BLOCK

    def scales(self, mod: nn.Module) -> ExpertScales:
        return ExpertScales(mod.gate_up_scale, mod.down_scale, mod.scale_rows)

    def dequantized(self, mod: nn.Module, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``e``'s (gate_up, down) in ``dtype``, as a load-time dequantization gives them."""
        return (dequantize(mod.gate_up_proj[e], mod.gate_up_scale[e], mod.scale_rows).to(dtype),
                dequantize(mod.down_proj[e], mod.down_scale[e], mod.scale_rows).to(dtype))

    def init_dummy(self, mod: nn.Module, gen: torch.Generator) -> None:
        """``--load-format dummy``: random experts (std 0.02), quantized an expert at a time."""
        for e in range(mod.num_experts):
            for proj in PROJS:
                rows, cols = _view(mod, e, proj)[0].shape
                w = torch.empty(rows, cols, device=mod.gate_up_proj.device).normal_(0.0, 0.02, generator=gen)
                store_weight(mod, e, proj, w, online=True)


def _grouped(s: torch.Tensor) -> torch.Tensor | None:
    """[E, R, KB] per-row scales -> [E, R / 128, KB] where each 128-row group is uniform, else None."""
    e, r, kb = s.shape
    if r % BLOCK:
        return None
    g = s.view(e, r // BLOCK, BLOCK, kb)
    return g[:, :, 0].contiguous() if torch.equal(g, g[:, :, :1].expand_as(g)) else None


def _view(mod: nn.Module, e: int, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight rows, scale rows) of expert ``e``'s projection ``proj`` (this rank's slice)."""
    i = mod.rows.size
    if proj == "gate_proj":
        return mod.gate_up_proj[e, :i], mod.gate_up_scale[e, :i]
    if proj == "up_proj":
        return mod.gate_up_proj[e, i:], mod.gate_up_scale[e, i:]
    return mod.down_proj[e], mod.down_scale[e]


def _full_shape(mod: nn.Module, proj: str) -> tuple[int, int]:
    """The checkpoint shape of one expert's projection (before the rank's cut)."""
    h = mod.down_proj.shape[1]
    return (h, mod.rows.full) if proj == "down_proj" else (mod.rows.full, h)


def store_weight(mod: nn.Module, e: int, proj: str, w: torch.Tensor, online: bool, name: str = "") -> None:
    """This rank's slice of expert ``e``'s ``proj`` (e4m3, or unquantized under online FP8)."""
    dst, scale = _view(mod, e, proj)
    if tuple(w.shape) != tuple(dst.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(w.shape)} != model shape {tuple(dst.shape)}")
    with torch.no_grad():
        if w.dtype == FP8:
            dst.copy_(w.to(dst.device))
            return
        if not online:
            raise ValueError(f"{name}: expected float8 weights, the checkpoint has {w.dtype}")
        w8, s = quantize_rows(w.to(dst.device))
        dst.copy_(w8)
        scale.copy_(s.expand_as(scale))


def store_scale(mod: nn.Module, e: int, proj: str, rows_scale: torch.Tensor, name: str) -> None:
    """Expert ``e``'s per-row scales of ``proj`` over the checkpoint's full shape [rows, KB] -> this
    rank's rows (gate, up) or 128-column groups (down)."""
    r = mod.rows
    if proj != "down_proj":
        s = rows_scale.narrow(0, r.start, r.size)
    elif rows_scale.shape[1] == 1 or r.size == r.full:
        s = rows_scale
    elif r.start % BLOCK or r.size % BLOCK:
        raise ValueError(f"{name}: --tp-size splits moe_intermediate_size at {r.start}, not a multiple of {BLOCK}")
    else:
        s = rows_scale[:, r.start // BLOCK: (r.start + r.size) // BLOCK]
    dst = _view(mod, e, proj)[1]
    if tuple(s.shape) != tuple(dst.shape):
        raise ValueError(f"{name}: scale of shape {tuple(rows_scale.shape)} does not fit the experts' layout")
    with torch.no_grad():
        dst.copy_(s.to(dst.device))


class ExpertsLoad:
    """Routes the checkpoint tensors of FP8 ``Experts`` modules (by module path) into them and
    tells which never came."""

    def __init__(self, modules: dict[str, nn.Module], online: bool):
        self.modules, self.online = modules, online
        self.seen: set[tuple[str, int, str, str]] = set()  # (path, expert, proj, "weight" | "scale")

    def owns(self, name: str) -> bool:
        module, _, leaf = name.rpartition(".")
        return module in self.modules and leaf in FUSED

    def take(self, name: str, get) -> bool:
        """Load ``name`` if it belongs to an FP8 experts module; False otherwise."""
        head, _, leaf = name.rpartition(".")
        if head in self.modules:  # fused: experts.gate_up_proj[_scale_inv]
            return self._fused(head, leaf, name, get)
        parts = name.rsplit(".", 3)  # per expert: experts.N.gate_proj.weight
        if len(parts) != 4 or parts[0] not in self.modules or parts[2] not in PROJS or not parts[1].isdigit():
            return False
        path, e, proj, leaf = parts[0], int(parts[1]), parts[2], parts[3]
        mod = self.modules[path]
        if e >= mod.num_experts or leaf not in ("weight", *SCALE_LEAVES, *INPUT_SCALE_LEAVES):
            return False
        if leaf == "weight":
            store_weight(mod, e, proj, mod.checkpoint_shard("weight", get(), proj), self.online, name)
            self.seen.add((path, e, proj, "weight"))
        elif leaf in SCALE_LEAVES:
            store_scale(mod, e, proj, per_row_scale(get(), *_full_shape(mod, proj)), name)
            self.seen.add((path, e, proj, "scale"))
        return True  # an input scale: read and dropped (expert activations stay unquantized)

    def _fused(self, path: str, leaf: str, name: str, get) -> bool:
        mod = self.modules[path]
        proj = leaf.removesuffix("_scale_inv")
        if leaf in INPUT_SCALE_LEAVES:
            return True
        if proj not in FUSED:
            return False
        t = get()
        if t.shape[0] != mod.num_experts:
            raise ValueError(f"{name}: {t.shape[0]} experts in the checkpoint, the config says {mod.num_experts}")
        parts = FUSED[proj]
        for e in range(mod.num_experts):
            for j, part in enumerate(parts):  # gate_up's gate rows come first, then its up rows
                rows, cols = _full_shape(mod, part)
                if leaf == proj:
                    w = t[e].narrow(0, j * rows, rows) if len(parts) > 1 else t[e]
                    store_weight(mod, e, part, mod.checkpoint_shard("weight", w, part), self.online, name)
                else:
                    s = per_row_scale(t[e], rows * len(parts), cols).narrow(0, j * rows, rows)
                    store_scale(mod, e, part, s, name)
                self.seen.add((path, e, part, "weight" if leaf == proj else "scale"))
        return True

    def missing(self, need_scales: bool) -> list[str]:
        out = []
        kinds = ("weight", "scale") if need_scales else ("weight",)
        for path, mod in self.modules.items():
            for e in range(mod.num_experts):
                for proj in PROJS:
                    out += [f"{path}.{e}.{proj}.{'weight' if k == 'weight' else 'weight_scale'}" for k in kinds
                            if (path, e, proj, k) not in self.seen]
        return out
