"""Gemma 4 text model (dense), as HF ``Gemma4ForCausalLM``.

What sets it apart from Llama, each mirrored from HF:
- two layer types with their own head_dim / kv heads / RoPE (full layers: "proportional" partial
  rotary) and a sliding window on the sliding ones; attention scaling 1.0;
- q_norm / k_norm / v_norm (v_norm has no weight); ``attention_k_eq_v`` full layers have no
  v_proj: the value is the raw k_proj output, normed by v_norm and never rotated;
- four norms per layer, a stored ``layer_scalar`` multiplying the layer output, embeddings scaled
  by sqrt(hidden) rounded to the weight dtype, final logit softcapping, tied lm_head;
- KV sharing: the last ``num_kv_shared_layers`` layers read the KV of the last earlier
  non-shared layer of their type and own no pool tensor;
- Per-Layer Embeddings (PLE) when ``hidden_size_per_layer_input`` > 0;
- ``enable_moe_block`` (26B-A4B): a MoE block beside each layer's dense MLP, routed on the
  residual stream before the MLP, with its own norms (``Gemma4DecoderLayer._moe``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.forward_batch import AttnLayer, ForwardBatch
from gpu_worker.kernels import Beside, use_triton
from gpu_worker.kernels.embed import embed_cat, embed_scaled
from gpu_worker.kernels.moe_norm import gemma_moe_combine, gemma_moe_inputs, gemma_moe_tail
from gpu_worker.kernels.softcap import softcap_float
from gpu_worker.kv_pool import KVLayerShape
from gpu_worker.models.base import CausalLM
from gpu_worker.models.config import Gemma4Spec, LayerSpec
from gpu_worker.models.layers import GatedMLP, GemmaRMSNorm, Rotary, gated, rope_attention
from gpu_worker.models.moe import Experts, Gemma4Router
from gpu_worker.parallel import factory, shard
from gpu_worker.parallel.state import tp_size

_SCALE_CACHE: dict[tuple[float, torch.dtype], float] = {}
# Token counts at which a MoE layer's dense MLP runs beside its router and experts: decode and
# verify batches, where launches rather than bytes or FLOPs bound the layer.
BESIDE_MAX_TOKENS = 64


def dtype_rounded(value: float, dtype: torch.dtype) -> float:
    """HF keeps scale constants as float32 tensors cast to the weight dtype at use (so sqrt(3072)
    becomes 55.5 in bf16). Multiplying by this exactly representable Python float rounds alike."""
    key = (value, dtype)
    if key not in _SCALE_CACHE:
        _SCALE_CACHE[key] = float(torch.tensor(value, dtype=torch.float32).to(dtype))
    return _SCALE_CACHE[key]


class Gemma4Attention(nn.Module):
    def __init__(self, spec: Gemma4Spec, layer: LayerSpec):
        super().__init__()
        h, d, eps = spec.hidden_size, layer.head_dim, spec.rms_norm_eps
        # This rank's heads (all at TP=1). KV-reading layers (sharing, the assistant) split
        # their queries by the same rule, so they read only this rank's KV heads.
        parts = factory.qkv_parts(spec.num_heads, layer.num_kv_heads, d, with_v=not layer.k_eq_v)
        self.num_heads, self.num_kv_heads = parts["q_proj"].size // d, parts["k_proj"].size // d
        self.head_dim = d
        self.owns_kv = layer.owns_kv
        self.attn: AttnLayer | None = None  # set by the model: it knows the physical KV layout
        self.q_norm = GemmaRMSNorm(d, eps)
        if self.owns_kv:  # shared layers have no k/v weights at all (HF drops them on load)
            self.qkv_proj = factory.merged(h, parts, bias=spec.attention_bias)
            self.k_norm = GemmaRMSNorm(d, eps)
            self.v_norm = GemmaRMSNorm(d, eps, with_scale=False)
        else:
            self.q_proj = factory.column(h, parts["q_proj"], bias=spec.attention_bias)
        self.o_proj = factory.row(parts["q_proj"], h, bias=spec.attention_bias)

    def forward(self, x: torch.Tensor, rotary: Rotary, fb: ForwardBatch, backend):
        t = x.shape[0]
        if not self.owns_kv:
            q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
            return self.o_proj(rope_attention(backend, self.attn, rotary, fb, q, q_norm=self.q_norm))
        parts = self.qkv_proj.split(self.qkv_proj(x))
        q = parts[0].view(t, self.num_heads, self.head_dim)
        k = parts[1].view(t, self.num_kv_heads, self.head_dim)
        # k_eq_v: value = the un-normed, un-rotated k_proj output, then v_norm
        v = parts[2].view(t, self.num_kv_heads, self.head_dim) if len(parts) == 3 else k
        o = rope_attention(backend, self.attn, rotary, fb, q, k, v, q_norm=self.q_norm, k_norm=self.k_norm,
                           v_norm=self.v_norm)
        return self.o_proj(o)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, spec: Gemma4Spec, layer: LayerSpec):
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.layer_type = layer.layer_type
        self.self_attn = Gemma4Attention(spec, layer)
        self.mlp = GatedMLP(h, layer.intermediate_size, spec.hidden_act)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.register_buffer("layer_scalar", torch.ones(1))  # persistent: stored in checkpoints
        self.eps = eps
        self.moe = layer.moe is not None
        if self.moe:  # HF's names: router, experts and three norms of their own on the layer
            self.router = Gemma4Router(h, layer.moe, eps)
            self.experts = Experts(h, layer.moe, spec.hidden_act)
            self.post_feedforward_layernorm_1 = GemmaRMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = GemmaRMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = GemmaRMSNorm(h, eps)
        self.ple_dim = spec.hidden_size_per_layer_input
        self.act_name = spec.hidden_act
        if self.ple_dim:
            self.per_layer_input_gate = nn.Linear(h, self.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(self.ple_dim, h, bias=False)
            self.post_per_layer_input_norm = GemmaRMSNorm(h, eps)

    def forward(self, h, x, per_layer_input, rotary: Rotary, fb: ForwardBatch, backend,
                next_norm: GemmaRMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """h: this layer's normed input, x: the residual stream; returns (``next_norm`` of the new
        stream, the stream). Each ``norm_add`` is HF's ``x = x + norm(h)`` (then the next norm)
        in one kernel; the last one (``* layer_scalar``) applies ``next_norm`` — the next layer's
        input norm or the final one — instead of a separate launch. The kernel path updates x
        in place."""
        h = self.self_attn(h, rotary, fb, backend)
        h, x = self.post_attention_layernorm.norm_add(h, x, next_norm=self.pre_feedforward_layernorm)
        if not self.moe:
            h = self.mlp(h)
        else:  # the dense MLP beside the router and the experts (on a second stream where it pays)
            dense = Beside(h, on=self.experts.gives_slots(x) and x.shape[0] <= BESIDE_MAX_TOKENS)
            with dense:
                dense.out = self.mlp(h)
            ended = None if self.ple_dim else self._moe_to_layer_end(dense, x, next_norm)
            if ended is not None:
                return ended, x
            h = self._moe(dense, x)
        if not self.ple_dim:
            return self.post_feedforward_layernorm.norm_add(h, x, next_norm=next_norm, scale=self.layer_scalar)
        _, x = self.post_feedforward_layernorm.norm_add(h, x)
        h = self.per_layer_projection(gated(self.act_name, self.per_layer_input_gate(x), per_layer_input))
        return self.post_per_layer_input_norm.norm_add(h, x, next_norm=next_norm, scale=self.layer_scalar)

    def _moe(self, dense: Beside, x: torch.Tensor) -> torch.Tensor:
        """HF: ``post_feedforward_layernorm_1(dense) + post_feedforward_layernorm_2(experts(
        pre_feedforward_layernorm_2(x)))``, the experts routed on x, the residual stream the MLP's
        input was normed from. On the kernel path the router's and the experts' inputs come from
        one kernel, and the two norms and their sum from another."""
        if use_triton(x):
            r, e = self._moe_router_and_experts_inputs(x)
            m = self.experts(e, *self.router.route(r))
            return gemma_moe_combine(dense.join(), m, self.post_feedforward_layernorm_1.weight,
                                     self.post_feedforward_layernorm_2.weight, self.eps)
        m = self.experts(self.pre_feedforward_layernorm_2(x), *self.router(x))
        return self.post_feedforward_layernorm_1(dense.join()) + self.post_feedforward_layernorm_2(m)


    def _moe_router_and_experts_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gemma_moe_inputs(x, self.router.scale, self.pre_feedforward_layernorm_2.weight, self.eps,
                                self.router.root)

    def _moe_to_layer_end(self, dense: Beside, x: torch.Tensor, next_norm: GemmaRMSNorm) -> torch.Tensor | None:
        """The MoE block and the layer's end (``post_feedforward_layernorm``'s residual add, the
        layer scalar, ``next_norm``) with the experts' slot sum in one kernel (``gemma_moe_tail``);
        None where the experts give no per-slot outputs (torch path, TP > 1): the caller runs
        ``_moe`` and the usual end. Updates x in place; returns ``next_norm(x)``."""
        if not self.experts.gives_slots(x):
            return None
        r, e = self._moe_router_and_experts_inputs(x)
        ids, weights = self.router.route(r)
        slots = self.experts.slots(e, ids, weights)
        return gemma_moe_tail(dense.join(), slots, x, self.post_feedforward_layernorm_1.weight,
                              self.post_feedforward_layernorm_2.weight, self.post_feedforward_layernorm.weight,
                              next_norm.weight, self.layer_scalar, self.eps, ids.shape[1])


class Gemma4Backbone(nn.Module):
    """HF's ``Gemma4TextModel`` (``model.*``): embeddings, PLE, layers, final norm."""

    def __init__(self, spec: Gemma4Spec):
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.embed_tokens = factory.embedding(spec.vocab_size, h)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(spec, layer) for layer in spec.layers)
        self.norm = GemmaRMSNorm(h, spec.rms_norm_eps)
        # One RoPE per layer type: each type has its own head_dim and frequencies.
        first = {}
        for layer in spec.layers:
            first.setdefault(layer.layer_type, layer)
        self.rotary = nn.ModuleDict({t: Rotary(layer.head_dim, layer.rope) for t, layer in first.items()})
        self.ple_dim = spec.hidden_size_per_layer_input
        if self.ple_dim:
            n = len(spec.layers)
            self.embed_tokens_per_layer = nn.Embedding(spec.vocab_size_per_layer_input, n * self.ple_dim)
            self.per_layer_model_projection = nn.Linear(h, n * self.ple_dim, bias=False)
            self.per_layer_projection_norm = GemmaRMSNorm(self.ple_dim, spec.rms_norm_eps)

    def optional_weights(self) -> dict[str, float]:
        # HF initialises layer_scalar to 1 when a checkpoint lacks it; real ones store it.
        return {f"model.layers.{i}.layer_scalar": 1.0 for i in range(len(self.layers))}

    def embed_scale(self) -> float:
        """sqrt(hidden), rounded to the model's dtype (HF's ``embed_scale``)."""
        return dtype_rounded(self.spec.hidden_size**0.5, self.norm.weight.dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size() > 1:  # a vocabulary-parallel table: its gather reduces across ranks
            return self.embed_tokens(ids) * self.embed_scale()
        table = self.embed_tokens.weight
        if table.dtype != self.norm.weight.dtype:  # a bfloat16 table under a float32 model (models/cpu_layout.py)
            return F.embedding(ids, table).to(self.norm.weight.dtype) * self.embed_scale()
        return embed_scaled(ids, table, self.embed_scale())

    def per_layer_inputs(self, ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """PLE: (norm(proj(embeds) / sqrt(H)) + embed_per_layer(ids) * sqrt(P)) / sqrt(2) -> [T, L, P]."""
        t, n, p = ids.shape[0], len(self.layers), self.ple_dim
        w = self.embed_tokens_per_layer.weight
        tok = (F.embedding(ids, w) * dtype_rounded(p**0.5, w.dtype)).view(t, n, p)
        proj = self.per_layer_model_projection(embeds) * (self.spec.hidden_size**-0.5)
        proj = self.per_layer_projection_norm(proj.view(t, n, p))
        return (proj + tok) * (2.0**-0.5)

    def run(self, x: torch.Tensor, ple: torch.Tensor | None, fb: ForwardBatch, backend) -> torch.Tensor:
        """Decoder layers + final norm over input embeddings x [T, H] (x is updated in place on
        the kernel path: pass a tensor nobody else reads)."""
        layers = self.layers
        h = layers[0].input_layernorm(x)
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            h, x = layer(h, x, ple[:, i] if ple is not None else None, self.rotary[layer.layer_type], fb, backend,
                         next_norm)
        return h


class Gemma4ForCausalLM(CausalLM):
    def __init__(self, spec: Gemma4Spec):
        super().__init__()
        if any(layer.kv_source == -1 for layer in spec.layers):
            raise ValueError("a Gemma 4 target cannot read another model's KV (that is the assistant)")
        self.spec = spec
        self.hidden_size = spec.hidden_size
        self.vocab_size = spec.vocab_size
        self.tie_word_embeddings = spec.tie_word_embeddings
        self.model = Gemma4Backbone(spec)
        self.lm_head = None if spec.tie_word_embeddings else factory.lm_head(spec.hidden_size, spec.vocab_size)
        self.kv_shapes: list[KVLayerShape] = []  # per rank: only this rank's KV heads
        self.kv_heads_total: list[int] = []  # the checkpoint's KV heads per pool layer
        self._physical: dict[int, int] = {}  # decoder layer owning KV -> pool layer
        for i, layer in enumerate(spec.layers):
            if layer.owns_kv:
                self._physical[i] = len(self.kv_shapes)
                self.kv_shapes.append(KVLayerShape(shard.local_kv_heads(layer.num_kv_heads), layer.head_dim))
                self.kv_heads_total.append(layer.num_kv_heads)
        for i, (layer, mod) in enumerate(zip(spec.layers, self.model.layers)):
            mod.self_attn.attn = AttnLayer(
                kv_layer=self.physical_kv_layer(i),
                sliding_window=layer.sliding_window,
                scaling=1.0,  # q/k are RMS-normed; HF uses no 1/sqrt(d)
                writes_kv=layer.owns_kv,
            )
        self.sliding_windows = tuple(sorted({w for layer in spec.layers if (w := layer.sliding_window)}))

    def physical_kv_layer(self, layer_idx: int) -> int:
        """Pool layer holding the KV that decoder layer ``layer_idx`` attends over."""
        src = self.spec.layers[layer_idx].kv_source
        return self._physical[layer_idx if src is None else src]

    def kv_owner_for_type(self, layer_type: str) -> int:
        """Pool layer of the last layer of ``layer_type`` (what HF hands the assistant)."""
        idx = [i for i, layer in enumerate(self.spec.layers) if layer.layer_type == layer_type]
        if not idx:
            raise ValueError(f"target has no {layer_type} layer")
        return self.physical_kv_layer(idx[-1])

    def layer_kv_shape(self, layer_type: str) -> KVLayerShape:
        return self.kv_shapes[self.kv_owner_for_type(layer_type)]

    def ignored_checkpoint_key(self, name: str) -> bool:
        if super().ignored_checkpoint_key(name):
            return True
        # HF checkpoints may still carry k/v weights for KV-shared layers; HF ignores them too.
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] == "self_attn":
            layer = self.spec.layers[int(parts[2])]
            return not layer.owns_kv and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm")
        return False

    def optional_weights(self) -> dict[str, float]:
        return self.model.optional_weights()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(ids)

    def embed_cat(self, ids: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        """``cat(embed(ids), tail)`` (the frozen-KV draft's input row) in one kernel where the
        embedding is whole (TP = 1); the gather, scale and cat otherwise."""
        table = self.model.embed_tokens.weight
        if tp_size() > 1 or table.dtype != tail.dtype:
            return torch.cat([self.embed(ids), tail], dim=-1)
        return embed_cat(ids, table, self.model.embed_scale(), tail)

    def forward(self, fb: ForwardBatch, backend) -> torch.Tensor:
        x = self.model.embed(fb.input_ids)
        ple = self.model.per_layer_inputs(fb.input_ids, x) if self.model.ple_dim else None
        return self.model.run(x, ple, fb, backend)

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Softcap in float32 (HF does it in the model dtype; identical in float32, finer in bf16).
        logits = factory.logits(hidden, self.lm_head_weight(), self.vocab_size)  # gathered: full vocab
        return softcap_float(logits, self.spec.final_logit_softcapping)


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The multimodal Gemma 4 checkpoint served as a text-only model.

    Its language model lives under ``model.language_model.*``; the vision/audio towers and
    their embedders are skipped. Text-only inputs give the same logits as HF's wrapper.
    """

    _TEXT_PREFIX = "model.language_model."

    def checkpoint_key(self, name: str) -> str | None:
        if name.startswith(self._TEXT_PREFIX):
            return "model." + name[len(self._TEXT_PREFIX) :]
        if name.startswith("model."):
            return None  # vision_tower, audio_tower, embed_vision, embed_audio, ...
        return name  # lm_head
