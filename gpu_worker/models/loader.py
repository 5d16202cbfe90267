"""Build a model from a HF checkpoint directory.

The module tree mirrors HF's names, so a checkpoint key ``model.layers.3.mlp.up_proj.weight`` is
our parameter of the same name. The model is built on the meta device (no allocation, no
random init), materialised empty on ``device`` in ``dtype``, then each tensor is read from the
safetensors files in its checkpoint dtype and cast into place.
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
from gpu_worker.models.layers import MergedLinear

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


def _materialize(cls, spec, dtype: torch.dtype, device: torch.device | str):
    if torch.device(device).type == "cpu":  # in place, initialisers skipped: no meta-device kernels run
        with torch.device("cpu"), _SkipInit():
            return cls(spec).to(dtype)
    with torch.device("meta"):
        model = cls(spec)
    # Cast on meta (free), then allocate once on the device: no float32 copy of a bf16 model.
    model.to(dtype)
    model.to_empty(device=device)
    return model


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


def load_weights(model, model_dir: Path) -> None:
    """Copy every checkpoint tensor into the matching parameter/buffer (or the rows of a merged
    projection that stand for it); fail on missing ones."""
    targets = model.state_dict(keep_vars=True)  # params + persistent buffers, by HF name
    merged = merged_targets(model)
    expected = _expected_names(targets, merged)
    seen: set[str] = set()
    unexpected: list[str] = []
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = model.checkpoint_key(key)
                if name is None:
                    continue
                found = _destination(targets, merged, name)
                if found is None:
                    if not model.ignored_checkpoint_key(name):
                        unexpected.append(key)
                    continue
                name, dst, module_path, part = found
                src = _rank_shard(model, module_path, name.rpartition(".")[2], part, f.get_tensor(key))
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
                with torch.no_grad():
                    dst.copy_(src.to(dtype=dst.dtype) if dst.is_floating_point() else src)
                seen.add(name)
    missing = [n for n in expected if n not in seen]
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
):
    """Load a target model, or a draft (``Gemma4AssistantForCausalLM``) bound to ``target``.

    ``load_format="dummy"`` gives random weights of the checkpoint's shapes (config.json only).
    """
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    arch = architecture_of(cfg)
    spec = parse_config(cfg)  # first: its errors name unsupported variants precisely
    cls = model_class(arch)
    if arch in DRAFT_ARCHITECTURES and target is None:
        raise ValueError(f"{arch} is a draft model: pass the loaded target as target=")
    model = _materialize(cls, spec, dtype, device)
    if arch in DRAFT_ARCHITECTURES:
        model.bind(target)  # before the weights: a pair that does not fit says why, not a shape
    if load_format == "dummy":
        model.init_dummy_()
    elif load_format == "auto":
        load_weights(model, model_dir)
    else:
        raise ValueError(f"load_format {load_format!r} is not supported (auto, dummy)")
    model.eval()
    model.requires_grad_(False)
    return model
