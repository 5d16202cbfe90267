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
from gpu_worker.kernels import qkv_rope, use_triton
from gpu_worker.kernels.activation import gated_act
from gpu_worker.kernels.gemv import gated_linear
from gpu_worker.kernels.norm import MODE_ADD_NORM, MODE_NORM, MODE_NORM_ADD, launch_norm
from gpu_worker.kernels.rope import NORM_GEMMA, NORM_LLAMA, NORM_NONE, rope_store
from gpu_worker.models.config import RopeSpec
from gpu_worker.parallel import factory, shard
from gpu_worker.parallel.linear import MergedLinear


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
        if use_triton(x):
            return launch_norm(MODE_NORM, x, None, self.weight, None, None, self.eps, gemma=False)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)  # HF multiplies in the input dtype

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual). The kernel path updates ``residual`` in place."""
        if use_triton(x):
            out = launch_norm(MODE_ADD_NORM, x, residual, self.weight, None, None, self.eps, gemma=False)
            return out, residual
        residual = x + residual
        return self.forward(residual), residual


class GemmaRMSNorm(nn.Module):
    """Gemma 4 RMSNorm: scale by ``weight`` (not 1 + weight) in float32 before the cast back.

    ``with_scale=False`` (Gemma 4's v_norm) has no weight at all.
    """

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            return launch_norm(MODE_NORM, x, None, self.weight, None, None, self.eps, gemma=True)
        x32 = x.float()
        # HF uses pow(-0.5) rather than rsqrt (JAX parity); keep it for bit-compatibility.
        out = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.type_as(x)

    def norm_add(self, x: torch.Tensor, residual: torch.Tensor, next_norm: "GemmaRMSNorm | None" = None,
                 scale: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Gemma's sandwich step: ``r = residual + self(x)`` [``* scale``]; returns
        ``(next_norm(r) or None, r)``. The kernel path updates ``residual`` in place."""
        if use_triton(x):
            w2 = next_norm.weight if next_norm is not None else None
            out = launch_norm(MODE_NORM_ADD, x, residual, self.weight, w2, scale, self.eps, gemma=True)
            return out, residual
        residual = residual + self.forward(x)
        if scale is not None:
            residual = residual * scale
        return (next_norm(residual) if next_norm is not None else None), residual


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
        # them in float32 on whatever device the buffer landed on. In place where the buffer is
        # still float32: a move that moves nothing (.cuda() of a model already there) keeps the
        # tensor, as it does every other parameter and buffer, so captured CUDA graphs, which hold
        # its address, stay valid (a fresh tensor here once left the piecewise prefill graphs
        # reading freed memory: tests/gpu/test_gpu_mtp_accept.py, "recapture").
        super()._apply(fn, recurse)
        fresh = rope_inv_freq(self.head_dim, self.rope)
        if self.inv_freq.dtype == torch.float32 and self.inv_freq.device.type != "meta":
            with torch.no_grad():
                self.inv_freq.copy_(fresh)
        else:
            self.inv_freq = fresh.to(self.inv_freq.device)
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


def gated(act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up, rounded like HF; one kernel on the device path."""
    if use_triton(gate):
        return gated_act(gate, up, act)
    return activation(act)(gate) * up


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up merged into one ``gate_up_proj``."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        # TP: gate/up split by columns, down by rows (one all-reduce); TP=1: the plain modules.
        self.gate_up_proj = factory.merged(hidden, factory.gate_up_parts(intermediate), bias=bias)
        self.down_proj = factory.row(shard.even(intermediate, "intermediate_size"), hidden, bias=bias)
        self.act_name = act
        activation(act)  # fail at build time on an unsupported activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Decode rows at TP=1: gate_up and the activation in one GEMV (kernels/gemv.py; FP8
        # weights: their quant method's). Under TP the column-parallel subclass may lay its shard
        # out differently: the general path.
        proj = self.gate_up_proj
        if type(proj) is MergedLinear and proj.bias is None:
            if proj.quant is None:
                h = gated_linear(x, proj.weight, self.act_name)
            else:
                h = proj.quant.gated(proj, x, self.act_name)
            if h is not None:
                return self.down_proj(h)
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(gated(self.act_name, gate, up))


def paged_attention(
    backend,
    layer: AttnLayer,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    fb: ForwardBatch,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (None: read the pool only) -> [T, Hq * Dv].

    The backend writes k/v at ``fb.out_loc`` (when given) before reading, so a query sees its own
    key; masks come from the per-forward metadata in ``fb.attn``.
    """
    if k is not None and not layer.writes_kv:
        raise ValueError("k/v given to a layer that does not write KV")
    out = backend.forward(layer, q, k, v, fb)
    return out.reshape(out.shape[0], -1)


def _norm_style(norm: nn.Module | None) -> int:
    if norm is None:
        return NORM_NONE
    return NORM_GEMMA if isinstance(norm, GemmaRMSNorm) else NORM_LLAMA


def rope_attention(backend, layer: AttnLayer, rotary: Rotary, fb: ForwardBatch, q, k=None, v=None, *,
                   q_norm=None, k_norm=None, v_norm=None) -> torch.Tensor:
    """Per-head norms, RoPE, KV store and paged attention for one layer -> [T, Hq * Dv].

    q [T, Hq, D]; k/v [T, Hkv, *] (column views of the qkv output) or None for a layer that
    only reads KV (Gemma 4 KV sharing, the frozen-KV draft). On the kernel path one launch
    norms, rotates and stores (``kernels/rope.py``) and the backend then only reads the pool.
    """
    writes = k is not None
    if use_triton(q):
        pool = backend.pool
        q = rope_store(
            q, k, v, fb.positions, rotary.inv_freq, fb.out_loc if writes else None,
            pool.k[layer.kv_layer] if writes else None, pool.v[layer.kv_layer] if writes else None,
            norm=_norm_style(q_norm), q_weight=getattr(q_norm, "weight", None),
            k_weight=getattr(k_norm, "weight", None), v_norm=v_norm is not None,
            eps=q_norm.eps if q_norm is not None else 1e-6,
            q_out=None if fb.scratch is None else fb.scratch.view("q", *q.shape),
            store_scales=pool.store_scales(layer.kv_layer),
        )
        return paged_attention(backend, layer, q, None, None, fb)
    key = id(rotary)
    if key not in fb.rope_cache:  # cos/sin once per forward and RoPE kind
        fb.rope_cache[key] = rotary(fb.positions, q.dtype)
    cos, sin = fb.rope_cache[key]
    if q_norm is not None:
        q = q_norm(q)
    q = apply_rope(q, cos, sin)
    if writes:
        k = apply_rope(k_norm(k) if k_norm is not None else k, cos, sin)
        v = v_norm(v) if v_norm is not None else v
    return paged_attention(backend, layer, q, k, v, fb)


def qkv_rope_attention(backend, layer: AttnLayer, rotary: Rotary, fb: ForwardBatch, qkv_proj: nn.Module,
                       x: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor | None:
    """One decode row of a Llama-style layer (no qkv bias, no per-head norm): the qkv GEMV
    rotates q and k and stores k / v in its epilogue (``kernels/qkv_rope.py``), then the backend
    reads the pool -> [1, Hq * D]. None where that kernel does not apply: the caller runs the
    projection and ``rope_attention``."""
    if not (fb.out_loc is not None and layer.writes_kv and type(qkv_proj) is MergedLinear and qkv_proj.bias is None
            and qkv_rope.applies(x, qkv_proj.weight, head_dim)):  # applies: one row on the kernel path
        return None
    pool = backend.pool
    fp8 = qkv_proj.quant.kernel_args(qkv_proj) if qkv_proj.quant is not None else {}
    q = qkv_rope.qkv_rope_store(
        x, qkv_proj.weight, fb.positions, rotary.inv_freq, fb.out_loc, pool.k[layer.kv_layer],
        pool.v[layer.kv_layer], num_heads, num_kv_heads, head_dim,
        q_out=None if fb.scratch is None else fb.scratch.view("q", 1, num_heads, head_dim),
        store_scales=pool.store_scales(layer.kv_layer), **fp8,
    )
    return paged_attention(backend, layer, q, None, None, fb)

