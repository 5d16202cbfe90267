"""Build a model from a HF checkpoint directory.

The module tree mirrors HF's names, so a checkpoint key ``model.layers.3.mlp.up_proj.weight`` is
our parameter of the same name. The model is built on the meta device (no allocation, no
random init), materialised empty on ``device`` in ``dtype``, then each tensor is read from the
safetensors files in its checkpoint dtype and cast into place. Two mappings are not one to one:
a merged projection takes each of its parts' tensors into its rows (``merged_targets``), and a
MoE layer's ``Experts`` takes either its fused 3-D tensors or every expert's own
``experts.N.{gate,up,down}_proj.weight`` (``_ExpertKeys``). FP8 projections (a quantized
checkpoint, or ``--quantization fp8``) are made so on the meta model, before allocation, and
load their tensors through ``gpu_worker.quant`` (``QuantLoad``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode

from gpu_worker.models import DRAFT_ARCHITECTURES, model_class
from gpu_worker.models.config import architecture_of, load_config, parse_config
from gpu_worker.models.moe import EXPERT_PROJS, Experts
from gpu_worker.parallel.linear import MergedLinear
from gpu_worker.quant import QuantLoad, fp8_weight_names, prepare_quant, resolve_format

log = logging.getLogger(__name__)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files: from the shard index when there is one, else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


class _SkipInit(TorchFunctionMode):
    """``torch.nn.init`` does nothing: every parameter is read from the checkpoint (or filled by
    ``init_dummy_``). (On the meta device any op runs torch's Python reference kernels, whose
    first call imports ``torch._dynamo``: ~75 MB of a CPU worker's memory and a second.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else next(iter((kwargs or {}).values()))
        return func(*args, **(kwargs or {}))


def _materialize(cls, spec, dtype: torch.dtype, device: torch.device | str, quantize) -> tuple[object, QuantLoad]:
    if torch.device(device).type == "cpu":  # in place, initialisers skipped: no meta-device kernels run
        with torch.device("cpu"), _SkipInit():
            model = cls(spec).to(dtype)
            return model, quantize(model)
    with torch.device("meta"):
        model = cls(spec)
    # Cast on meta (free), quantize the FP8 projections, then allocate once on the device: no
    # float32 copy of a bf16 model, no bf16 copy of an FP8 one.
    model.to(dtype)
    quant = quantize(model)
    model.to_empty(device=device)
    return model, quant


def merged_targets(model) -> dict[str, tuple[str, int, int]]:
    """Checkpoint module path of each part of a merged projection -> (our module path, row
    offset, rows): ``...self_attn.k_proj`` -> (``...self_attn.qkv_proj``, q rows, k rows)."""
    out = {}
    for path, mod in model.named_modules():
        if isinstance(mod, MergedLinear):
            parent = path.rsplit(".", 1)[0]
            for part in mod.parts:
                out[f"{parent}.{part}"] = (path, *mod.shard(part))
    return out


class _ExpertKeys:
    """Per-expert checkpoint keys of the model's ``Experts`` modules: where each one goes, and
    which of them arrived, so a fused parameter counts as loaded once every expert's part of it
    did (``experts.gate_up_proj`` needs each expert's gate and up, ``down_proj`` each down)."""

    def __init__(self, model):
        self.modules = {path: m for path, m in model.named_modules() if isinstance(m, Experts)}
        self.seen: dict[str, set[tuple[int, str]]] = {}

    def destination(self, name: str) -> tuple[str, torch.Tensor, str, str] | None:
        """(name, the expert's slice of the fused parameter, module path, projection)."""
        parts = name.rsplit(".", 3)
        if len(parts) != 4 or parts[0] not in self.modules or parts[3] != "weight" or parts[2] not in EXPERT_PROJS:
            return None
        mod, index = self.modules[parts[0]], parts[1]
        if not index.isdigit() or int(index) >= mod.num_experts:
            return None
        return name, mod.expert_view(int(index), parts[2]), parts[0], parts[2]

    def note(self, module_path: str, name: str) -> None:
        index, proj = name[len(module_path) + 1 :].split(".")[:2]
        self.seen.setdefault(module_path, set()).add((int(index), proj))

    def complete(self) -> set[str]:
        """The fused parameter names every expert's parts have filled."""
        done = set()
        for path, got in self.seen.items():
            e = self.modules[path].num_experts
            if all((i, p) in got for i in range(e) for p in ("gate_proj", "up_proj")):
                done.add(f"{path}.gate_up_proj")
            if all((i, "down_proj") in got for i in range(e)):
                done.add(f"{path}.down_proj")
        return done


def _destination(targets: dict, merged: dict, name: str) -> tuple[str, torch.Tensor, str, str | None] | None:
    """(the name we count as loaded, the tensor to copy into, its module path, the merged part
    or None) for our name of a checkpoint key."""
    if name in targets:
        return name, targets[name], name.rpartition(".")[0], None
    module, _, leaf = name.rpartition(".")
    if module in merged:
        path, offset, rows = merged[module]
        dst = targets.get(f"{path}.{leaf}")
        if dst is not None:
            return name, dst.narrow(0, offset, rows), path, module.rpartition(".")[2]
    return None


def _rank_shard(model, module_path: str, leaf: str, part: str | None, src: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a full checkpoint tensor (tensor parallelism); the whole tensor for
    every module that is not split (all of them at TP=1)."""
    try:
        mod = model.get_submodule(module_path) if module_path else model
    except AttributeError:
        return src
    cut = getattr(mod, "checkpoint_shard", None)
    return src if cut is None else cut(leaf, src, part)


def load_weights(model, model_dir: Path, quant: QuantLoad) -> None:
    """Copy every checkpoint tensor into the matching parameter/buffer (or the rows of a merged
    projection that stand for it); fail on missing ones. ``quant`` takes the FP8 projections'
    tensors first."""
    targets = model.state_dict(keep_vars=True)  # params + persistent buffers, by HF name
    merged = merged_targets(model)
    experts = _ExpertKeys(model)
    expected = [n for n in _expected_names(targets, merged) if not quant.owns(n)]
    seen: set[str] = set()
    unexpected: list[str] = []

    def put(name: str, tensor: torch.Tensor, key: str | None = None) -> None:
        found = _destination(targets, merged, name) or experts.destination(name)
        if found is None:
            if not model.ignored_checkpoint_key(name):
                unexpected.append(key or name)
            return
        name, dst, module_path, part = found
        src = _rank_shard(model, module_path, name.rpartition(".")[2], part, tensor)
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(src.to(dtype=dst.dtype) if dst.is_floating_point() else src)
        seen.add(name)
        if module_path in experts.modules and part is not None:
            experts.note(module_path, name)

    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = model.checkpoint_key(key)
                if name is not None and not quant.take(name, lambda: f.get_tensor(key), put):
                    put(name, f.get_tensor(key), key)
    seen |= experts.complete()
    missing = [n for n in expected if n not in seen] + quant.finish()
    optional = model.optional_weights()
    for name in [n for n in missing if n in optional]:
        log.warning("%s not in checkpoint; using %s", name, optional[name])
        with torch.no_grad():
            targets[name].fill_(optional[name])
    missing = [n for n in missing if n not in optional]
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} tensors, e.g. {missing[:8]}")
    if unexpected:
        log.warning("ignoring %d unexpected checkpoint tensors, e.g. %s", len(unexpected), unexpected[:8])


def _expected_names(targets: dict, merged: dict) -> list[str]:
    """Every checkpoint-side name the model needs: a merged tensor counts once per part."""
    parts: dict[str, list[str]] = {}
    for part, (path, _, _) in merged.items():
        parts.setdefault(path, []).append(part)
    names = []
    for name in targets:
        module, _, leaf = name.rpartition(".")
        names.extend(f"{p}.{leaf}" for p in parts[module]) if module in parts else names.append(name)
    return names


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    target=None,
    quantization: str | None = None,
):
    """Load a target model, or a draft (``Gemma4AssistantForCausalLM``) bound to ``target``.

    ``load_format="dummy"`` gives random weights of the checkpoint's shapes (config.json only).
    ``quantization`` is ``--quantization`` (None: as the checkpoint says). The model's
    ``kv_scales`` holds the checkpoint's per-layer k / v scales (pool layer -> (k, v)), if any.
    """
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    arch = architecture_of(cfg)
    spec = parse_config(cfg)  # first: its errors name unsupported variants precisely
    fmt = resolve_format(cfg, quantization)
    cls = model_class(arch)
    if arch in DRAFT_ARCHITECTURES and target is None:
        raise ValueError(f"{arch} is a draft model: pass the loaded target as target=")
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format {load_format!r} is not supported (auto, dummy)")
    files = checkpoint_files(model_dir) if load_format == "auto" else []
    model, quant = _materialize(cls, spec, dtype, device,
                                lambda m: prepare_quant(m, fmt, fp8_weight_names(m, files)))
    if arch in DRAFT_ARCHITECTURES:
        model.bind(target)  # before the weights: a pair that does not fit says why, not a shape
    if load_format == "dummy":
        model.init_dummy_()
        quant.init_dummy()
    else:
        load_weights(model, model_dir, quant)
    model.kv_scales = quant.kv_scales()
    model.quant_format = fmt
    model.eval()
    model.requires_grad_(False)
    return model
