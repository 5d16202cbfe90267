"""Llama 2/3, Mistral, Qwen2, Qwen3 and Qwen3-MoE: one pre-norm decoder, parameterised by
``LlamaSpec``.

Differences between the families are flags on the spec: q/k/v(/o) biases (Qwen2, Llama with
attention_bias), per-head q/k RMSNorm before RoPE (Qwen3), sliding windows (Mistral, Qwen with
use_sliding_window), llama3 RoPE scaling, tied embeddings, and a sparse MoE block in place of
the MLP on the layers whose ``LayerSpec.moe`` is set (Qwen3-MoE, ``models/moe.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.forward_batch import AttnLayer, ForwardBatch
from gpu_worker.kv_pool import KVLayerShape
from gpu_worker.models.base import CausalLM
from gpu_worker.models.config import LayerSpec, LlamaSpec
from gpu_worker.models.layers import GatedMLP, RMSNorm, Rotary, qkv_rope_attention, rope_attention
from gpu_worker.kernels.moe_norm import moe_sum_add_norm
from gpu_worker.models.moe import Slots, SparseMoE
from gpu_worker.parallel import factory, shard


def add_norm(norm: RMSNorm, h: torch.Tensor | Slots, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(h + residual), h + residual), ``residual`` updated in place on the kernel path; a MoE
    layer's unsummed ``Slots`` are summed in the same kernel."""
    if isinstance(h, Slots):
        return moe_sum_add_norm(h.rows, residual, norm.weight, norm.eps, h.top_k), residual
    return norm.add_forward(h, residual)


class LlamaAttention(nn.Module):
    def __init__(self, spec: LlamaSpec, layer: LayerSpec, attn: AttnLayer):
        super().__init__()
        h, d = spec.hidden_size, layer.head_dim
        # This rank's heads (all of them at TP=1): queries split, KV heads split or replicated.
        parts = factory.qkv_parts(spec.num_heads, layer.num_kv_heads, d)
        self.num_heads, self.num_kv_heads = parts["q_proj"].size // d, parts["k_proj"].size // d
        self.head_dim = d
        self.attn = attn
        self.qkv_proj = factory.merged(h, parts, bias=spec.qkv_bias)
        self.o_proj = factory.row(parts["q_proj"], h, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rotary: Rotary, fb: ForwardBatch, backend):
        t = x.shape[0]
        if self.q_norm is None:  # one decode row: RoPE and the KV store in the qkv GEMV
            o = qkv_rope_attention(backend, self.attn, rotary, fb, self.qkv_proj, x, self.num_heads,
                                   self.num_kv_heads, self.head_dim)
            if o is not None:
                return self.o_proj(o)
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        # Qwen3: per-head norm before RoPE
        o = rope_attention(backend, self.attn, rotary, fb, q, k, v, q_norm=self.q_norm, k_norm=self.k_norm)
        return self.o_proj(o)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec, layer: LayerSpec, attn: AttnLayer):
        super().__init__()
        self.self_attn = LlamaAttention(spec, layer, attn)
        if layer.moe is not None:
            self.mlp = SparseMoE(spec.hidden_size, layer.moe, spec.hidden_act)
        else:
            self.mlp = GatedMLP(spec.hidden_size, layer.intermediate_size, spec.hidden_act, bias=spec.mlp_bias)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rotary: Rotary, fb: ForwardBatch,
                backend) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer output, residual stream). The residual add is deferred into the next norm
        (``add_norm``): HF's ``residual + h`` then norm, in one kernel (a MoE layer's output may
        be its unsummed ``Slots``)."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = add_norm(self.input_layernorm, h, residual)
        h = self.self_attn(h, rotary, fb, backend)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaBackbone(nn.Module):
    """HF's ``model.*`` submodule: embeddings, layers, final norm."""

    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.embed_tokens = factory.embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                spec,
                layer,
                AttnLayer(kv_layer=i, sliding_window=layer.sliding_window, scaling=layer.head_dim**-0.5),
            )
            for i, layer in enumerate(spec.layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # Every layer shares one head_dim and RoPE.
        self.rotary = Rotary(spec.layers[0].head_dim, spec.layers[0].rope)


class LlamaForCausalLM(CausalLM):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.spec = spec
        self.hidden_size = spec.hidden_size
        self.vocab_size = spec.vocab_size
        self.tie_word_embeddings = spec.tie_word_embeddings
        # Per rank: the pool holds only this rank's KV heads.
        self.kv_shapes = [KVLayerShape(shard.local_kv_heads(layer.num_kv_heads), layer.head_dim)
                          for layer in spec.layers]
        self.sliding_windows = tuple(sorted({w for layer in spec.layers if (w := layer.sliding_window)}))
        self.model = LlamaBackbone(spec)
        self.lm_head = None if spec.tie_word_embeddings else factory.lm_head(spec.hidden_size, spec.vocab_size)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        # (to the norms' dtype: a bfloat16 table under a float32 model, models/cpu_layout.py)
        return self.model.embed_tokens(ids).to(self.model.norm.weight.dtype)

    def forward(self, fb: ForwardBatch, backend) -> torch.Tensor:
        h, residual = self.embed(fb.input_ids), None
        for layer in self.model.layers:
            h, residual = layer(h, residual, self.model.rotary, fb, backend)
        return add_norm(self.model.norm, h, residual)[0]

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # In the model dtype, as HF's lm_head: every consumer that needs float32 (softmax,
        # penalties, logprobs) converts, and greedy argmax is the same on either. Skipping the
        # cast saves a [rows, vocab] pass per step (110 us at 256 rows of Qwen3's 152k vocab).
        return factory.logits(hidden, self.lm_head_weight(), self.vocab_size)
