"""Building blocks shared by the model files: norms, RoPE, gated MLP, paged attention call.

Each block reproduces the exact arithmetic order and dtype casts of its HF transformers
counterpart, so float32 logits match HF to ~1e-5 and bf16 ones round the same way.
Tensors are flat: [T, ...] with no batch dimension.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.forward_batch import AttnLayer, ForwardBatch
from gpu_worker.models.config import RopeSpec


def activation(name: str):
    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"activation {name!r} is not supported")


class RMSNorm(nn.Module):
    """Llama/Qwen RMSNorm: normalise in float32, cast back, then multiply by the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)  # HF multiplies in the input dtype


class GemmaRMSNorm(nn.Module):
    """Gemma 4 RMSNorm: scale by ``weight`` (not 1 + weight) in float32 before the cast back.

    ``with_scale=False`` (Gemma 4's v_norm) has no weight at all.
    """

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        # HF uses pow(-0.5) rather than rsqrt (JAX parity); keep it for bit-compatibility.
        out = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.type_as(x)


# --------------------------------------------------------------------------- RoPE


def rope_inv_freq(head_dim: int, rope: RopeSpec) -> torch.Tensor:
    """float32 inverse frequencies [head_dim // 2], computed exactly like HF's rope init functions."""
    base = rope.theta
    if rope.rope_type == "proportional":
        # Gemma 4 full layers: only the first `partial * head_dim / 2` frequency pairs rotate; the
        # rest get frequency 0 (cos 1, sin 0), i.e. pass through. Exponent is over head_dim.
        angles = int(rope.partial_rotary_factor * head_dim // 2)
        exps = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim
        inv = 1.0 / (base**exps)
        nope = head_dim // 2 - angles
        if nope > 0:
            inv = torch.cat([inv, torch.zeros(nope, dtype=torch.float32)])
        return inv / rope.factor
    if rope.rope_type == "default":
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv, rope)
    raise ValueError(f"rope_type {rope.rope_type!r} is not supported")


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling (HF ``_compute_llama3_parameters``)."""
    factor, old_len = rope.factor, rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rotary(nn.Module):
    """cos/sin for one (head_dim, RoPE) pair. ``inv_freq`` stays float32 whatever ``.to()`` does."""

    def __init__(self, head_dim: int, rope: RopeSpec):
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope), persistent=False)

    def _apply(self, fn, recurse=True):
        # A model-wide .to(bfloat16) or .to_empty() would round or wipe the frequencies; recompute
        # them in float32 on whatever device the buffer landed on.
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.head_dim, self.rope).to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, head_dim] in ``dtype`` (HF: float32 math, then cast)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D] (neox / rotate-half layout, as HF)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


# --------------------------------------------------------------------------- MLP / attention


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); HF names, so checkpoint keys map one to one."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def paged_attention(
    backend,
    layer: AttnLayer,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    fb: ForwardBatch,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (None: Q-only read of ``layer.kv_layer``) -> [T, Hq * Dv].

    The backend writes k/v at ``fb.out_loc`` (when given) before reading, so a query sees its own
    key; masks come from the per-forward metadata in ``fb.attn``.
    """
    if k is not None and not layer.writes_kv:
        raise ValueError("k/v given to a layer that does not write KV")
    out = backend.forward(layer, q, k, v, fb)
    return out.reshape(out.shape[0], -1)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap
