"""Gemma 4 text target and Gemma 4 assistant (frozen-KV MTP draft) in plain PyTorch.

The math mirrors transformers' `Gemma4ForCausalLM` / `Gemma4AssistantForCausalLM` (5.17 and 5.24)
op for op: RMSNorm in fp32 with a plain `weight` scale, q/k RMSNorm + scale-less v RMSNorm,
attention scaling 1.0, `rotate_half` RoPE per layer type ("default" on sliding layers,
"proportional" with partial_rotary_factor on full layers), sandwich norms, `layer_scalar`,
embeddings scaled by sqrt(hidden) cast to the weight dtype, tied lm_head, final logit softcap.
State-dict keys are HF's, so export is a dtype cast.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

SLIDING, FULL = "sliding_attention", "full_attention"

# RoPE position of EVERY draft step, as an offset from committed_len (= the bonus token's index).
# "bonus_index" (offset 0) is HF transformers' SinglePositionMultiTokenCandidateGenerator
# convention and what our engine serves (docs/design.md §5); "last_committed" (offset -1) is sglang's.
DRAFT_POSITION = "bonus_index"
POSITION_OFFSETS = {"bonus_index": 0, "last_committed": -1}


@dataclass
class TextArch:
    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 1024
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    layer_types: list[str] = field(default_factory=lambda: [SLIDING] * 3 + [FULL] + [SLIDING] * 3 + [FULL])
    sliding_window: int = 128
    rope_theta_sliding: float = 10_000.0
    rope_theta_full: float = 1_000_000.0
    partial_rotary_factor_full: float = 0.25
    final_logit_softcapping: float | None = 30.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    def rope_parameters(self) -> dict:
        return {
            SLIDING: {"rope_type": "default", "rope_theta": self.rope_theta_sliding},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": self.partial_rotary_factor_full,
                   "rope_theta": self.rope_theta_full},
        }

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------------------------
# building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.with_scale = with_scale
        if with_scale:
            self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.with_scale:
            y = y * self.weight.float()
        return y.type_as(x)


def rope_inv_freq(arch: TextArch, layer_type: str) -> torch.Tensor:
    hd = arch.head_dim
    if layer_type == SLIDING:  # HF "default"
        return 1.0 / (arch.rope_theta_sliding ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    # HF "proportional": the first partial_rotary_factor of the frequencies rotate, the rest are 0
    angles = int(arch.partial_rotary_factor_full * hd // 2)
    rot = 1.0 / (arch.rope_theta_full ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / hd))
    return torch.cat([rot, torch.zeros(hd // 2 - angles, dtype=torch.float32)])


class Rotary(nn.Module):
    def __init__(self, arch: TextArch):
        super().__init__()
        for t in sorted(set(arch.layer_types)):
            self.register_buffer(f"{t}_inv_freq", rope_inv_freq(arch, t), persistent=False)

    def forward(self, positions: torch.Tensor, layer_type: str, dtype: torch.dtype):
        inv = getattr(self, f"{layer_type}_inv_freq")
        freqs = positions[..., None].float() * inv.float()
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, hd]; cos/sin [B or 1, T, hd]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin


def attend(q, k, v, mask=None, is_causal=False):
    """q [B, H, Tq, hd], k/v [B, KV, Tk, hd]; Gemma 4 attention scaling is 1.0."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=1.0)


class Attention(nn.Module):
    def __init__(self, arch: TextArch, q_only: bool = False):
        super().__init__()
        d, h, kv, hd = arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        self.h, self.hd, self.q_only = h, hd, q_only
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.q_norm = RMSNorm(hd, arch.rms_norm_eps)
        if not q_only:
            self.k_proj = nn.Linear(d, kv * hd, bias=False)
            self.v_proj = nn.Linear(d, kv * hd, bias=False)
            self.k_norm = RMSNorm(hd, arch.rms_norm_eps)
            self.v_norm = RMSNorm(hd, arch.rms_norm_eps, with_scale=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)

    def forward(self, x, cos, sin, attn_fn):
        b, t, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, t, self.h, self.hd)), cos, sin).transpose(1, 2)
        k = v = None
        if not self.q_only:
            k = apply_rope(self.k_norm(self.k_proj(x).view(b, t, -1, self.hd)), cos, sin).transpose(1, 2)
            v = self.v_norm(self.v_proj(x).view(b, t, -1, self.hd)).transpose(1, 2)
        o = attn_fn(q, k, v)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.h * self.hd))


class MLP(nn.Module):
    def __init__(self, arch: TextArch):
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, arch: TextArch, layer_type: str, q_only: bool = False):
        super().__init__()
        d, eps = arch.hidden_size, arch.rms_norm_eps
        self.layer_type = layer_type
        self.self_attn = Attention(arch, q_only)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.pre_feedforward_layernorm = RMSNorm(d, eps)
        self.post_feedforward_layernorm = RMSNorm(d, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.dropout = 0.0  # residual-branch dropout, training only (not part of the served math)

    def forward(self, x, cos, sin, attn_fn):
        h = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, attn_fn))
        x = x + (F.dropout(h, self.dropout, True) if self.training and self.dropout else h)
        h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + (F.dropout(h, self.dropout, True) if self.training and self.dropout else h)
        return x * self.layer_scalar


class _Body(nn.Module):
    """`model.` prefix container: embed_tokens, layers, norm (HF key layout)."""

    def __init__(self, arch: TextArch, q_only: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(arch, t, q_only) for t in arch.layer_types])
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


def sliding_causal_mask(t: int, window: int, device) -> torch.Tensor:
    i = torch.arange(t, device=device)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)  # HF: kv > q - window


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """Training init only. Gemma 4 attends with scaling 1.0 after q/k RMSNorm; starting the q/k
    norm scales at head_dim**-0.25 makes initial logits match the usual 1/sqrt(head_dim)."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std)
        if isinstance(m, Attention):
            nn.init.constant_(m.q_norm.weight, m.hd ** -0.25)
            if not m.q_only:
                nn.init.constant_(m.k_norm.weight, m.hd ** -0.25)


# ----------------------------------------------------------------------------------------------
# target


class TargetLM(nn.Module):
    def __init__(self, arch: TextArch):
        super().__init__()
        self.arch = arch
        self.model = _Body(arch, q_only=False)
        self.rotary = Rotary(arch)
        init_weights(self)
        # the assistant reads the KV of the last target layer of each type
        self.kv_source = {t: max(i for i, lt in enumerate(arch.layer_types) if lt == t)
                          for t in set(arch.layer_types)}

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight
        return F.embedding(ids, w) * torch.tensor(self.arch.hidden_size ** 0.5).to(w.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        out = F.linear(h, self.model.embed_tokens.weight)
        cap = self.arch.final_logit_softcapping
        return torch.tanh(out / cap) * cap if cap else out

    def set_dropout(self, p: float) -> None:
        for layer in self.model.layers:
            layer.dropout = p

    def forward(self, ids: torch.Tensor, kv_layers=(), cache=None):
        """Full causal pass from position 0. Returns (logits, final-normed hidden, {layer: (k, v)}).

        kv_layers: layer indices whose post-norm/post-RoPE K and V [B, KV, T, hd] to return.
        cache: optional list of preallocated (K, V) [B, KV, Lmax, hd] buffers to fill (prefill).
        """
        b, t = ids.shape
        x = self.embed(ids)
        pos = torch.arange(t, device=ids.device)[None]
        cs = {lt: self.rotary(pos, lt, x.dtype) for lt in set(self.arch.layer_types)}
        w = self.arch.sliding_window
        swa_mask = sliding_causal_mask(t, w, ids.device) if t > w else None
        kvs = {}
        for i, layer in enumerate(self.model.layers):
            sliding = layer.layer_type == SLIDING

            def attn_fn(q, k, v, i=i, sliding=sliding):
                if i in kv_layers:
                    kvs[i] = (k, v)
                if cache is not None:
                    cache[i][0][:, :, :t] = k
                    cache[i][1][:, :, :t] = v
                if sliding and swa_mask is not None:
                    return attend(q, k, v, mask=swa_mask)
                return attend(q, k, v, is_causal=True)

            x = layer(x, *cs[layer.layer_type], attn_fn)
        h = self.model.norm(x)
        return self.logits(h), h, kvs

    def new_cache(self, b: int, max_len: int, dtype, device):
        a = self.arch
        return [(torch.zeros(b, a.num_key_value_heads, max_len, a.head_dim, dtype=dtype, device=device),
                 torch.zeros(b, a.num_key_value_heads, max_len, a.head_dim, dtype=dtype, device=device))
                for _ in a.layer_types]

    def decode(self, ids: torch.Tensor, t: int, cache):
        """One token per row at position t (all rows the same length). Returns (logits, hidden)."""
        x = self.embed(ids)
        pos = torch.full((1, 1), t, device=ids.device, dtype=torch.long)
        cs = {lt: self.rotary(pos, lt, x.dtype) for lt in set(self.arch.layer_types)}
        lo = max(0, t - self.arch.sliding_window + 1)
        for i, layer in enumerate(self.model.layers):
            def attn_fn(q, k, v, i=i, sliding=layer.layer_type == SLIDING):
                kc, vc = cache[i]
                kc[:, :, t:t + 1] = k
                vc[:, :, t:t + 1] = v
                s = lo if sliding else 0
                return attend(q, kc[:, :, s:t + 1], vc[:, :, s:t + 1])

            x = layer(x, *cs[layer.layer_type], attn_fn)
        h = self.model.norm(x)
        return self.logits(h), h


# ----------------------------------------------------------------------------------------------
# assistant (draft)


def draft_arch_from(target: TextArch, hidden_size: int, intermediate_size: int,
                    num_attention_heads: int, layer_types: list[str]) -> TextArch:
    """Q heads are free; head_dim, kv heads, window and RoPE must be the target's (it reads its KV)."""
    return replace(target, hidden_size=hidden_size, intermediate_size=intermediate_size,
                   num_attention_heads=num_attention_heads, layer_types=list(layer_types),
                   final_logit_softcapping=None)  # HF's assistant applies no softcap


class Assistant(nn.Module):
    """Gemma4AssistantForCausalLM: pre_projection -> Q-only layers over target KV -> norm ->
    lm_head (tied to model.embed_tokens, plain, no centroids) and post_projection."""

    def __init__(self, arch: TextArch, backbone_hidden_size: int):
        super().__init__()
        self.arch = arch
        self.backbone_hidden_size = backbone_hidden_size
        self.model = _Body(arch, q_only=True)
        self.pre_projection = nn.Linear(2 * backbone_hidden_size, arch.hidden_size, bias=False)
        self.post_projection = nn.Linear(arch.hidden_size, backbone_hidden_size, bias=False)
        self.rotary = Rotary(arch)
        init_weights(self)

    def step(self, inputs_embeds, positions, kv: dict, masks: dict):
        """inputs_embeds [B, Q, 2*Ht] = cat(target_embed(token), prev_hidden); positions [1|B, Q];
        kv[type] = target (K, V) [B, KV, L, hd]; masks[type] bool [Q, L] (or [B,1,Q,L]) or None.
        Returns (logits [B, Q, V], next prev_hidden [B, Q, Ht])."""
        x = self.pre_projection(inputs_embeds)
        cs = {lt: self.rotary(positions, lt, x.dtype) for lt in set(self.arch.layer_types)}
        for layer in self.model.layers:
            lt = layer.layer_type

            def attn_fn(q, _k, _v, lt=lt):
                return attend(q, kv[lt][0], kv[lt][1], mask=masks.get(lt))

            x = layer(x, *cs[lt], attn_fn)
        normed = self.model.norm(x)
        return F.linear(normed, self.model.embed_tokens.weight), self.post_projection(normed)


def frozen_kv_masks(length: int, window: int, device) -> dict:
    """Query c (committed_len) sees target keys j < c; sliding layers only j >= c - window.
    Query 0 has no keys: let it see key 0 to stay finite (callers never use c = 0)."""
    c = torch.arange(length, device=device)
    full = c[None, :] < c[:, None]
    sliding = full & (c[None, :] >= c[:, None] - window)
    full[0, 0] = sliding[0, 0] = True
    return {FULL: full, SLIDING: sliding}


def draft_all_positions(target: TargetLM, assistant: Assistant, ids: torch.Tensor, h: torch.Tensor,
                        kv: dict, steps: int, position_offset: int = 0, masks: dict | None = None):
    """Unrolled draft for every committed length c of each row at once (teacher-forced tokens).

    Seed for query c: bonus token ids[c] and target hidden h[c-1]. Step k (1-based) feeds token
    ids[c+k-1] (k >= 2: the next token on the row, i.e. the target's own choice on a greedy
    rollout) and the previous step's post_projection output; it predicts token c+k. Every step
    uses RoPE position c + position_offset and keys [0, c) (window-limited on sliding layers).
    Returns a list of S logits tensors [B, L, V]; entry k-1 at column c predicts token c+k.
    """
    b, length = ids.shape
    masks = masks if masks is not None else frozen_kv_masks(length, target.arch.sliding_window, ids.device)
    c = torch.arange(length, device=ids.device)
    positions = (c + position_offset).clamp(min=0)[None]
    prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
    out = []
    for k in range(1, steps + 1):
        tok = ids[:, k - 1:]
        if k > 1:
            tok = torch.cat([tok, tok.new_zeros(b, k - 1)], dim=1)
        emb = target.embed(tok)
        logits, prev = assistant.step(torch.cat([emb, prev.to(emb.dtype)], dim=-1), positions, kv, masks)
        out.append(logits)
    return out


def target_kv_for_draft(target: TargetLM, kvs: dict) -> dict:
    return {lt: kvs[i] for lt, i in target.kv_source.items()}


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
