"""The Gemma 4 assistant (frozen-KV MTP draft), as HF ``Gemma4AssistantForCausalLM``.

One draft step, per row (docs/design.md §5):
    z = pre_projection(cat(target_embed(token), prev_hidden))       # [R, 2*Ht] -> [R, Ha]
    h = norm(decoder layers over z)   # Q-only attention over the TARGET's KV, no KV written
    logits = lm_head(h)  or the centroid-masked head (use_ordered_embeddings)
    next_hidden = post_projection(h)                                 # [R, Ht], the next prev_hidden
Each assistant layer reads the KV of the target's last layer of the same type (what HF's target
returns as ``shared_kv_states[layer_type]``). HF applies no final logit softcapping here, on
either head, so neither do we.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.forward_batch import AttnLayer, ForwardBatch
from gpu_worker.kernels.argmax import argmax_last
from gpu_worker.models.base import CausalLM
from gpu_worker.models.config import Gemma4AssistantSpec
from gpu_worker.models.gemma4 import Gemma4Backbone
from gpu_worker.parallel import factory, shard
from gpu_worker.parallel.linear import Linear
from gpu_worker.parallel.layers import vocab_rows_logits
from gpu_worker.parallel.state import tp_size


class Gemma4AssistantMaskedEmbedder(nn.Module):
    """Centroid-masked LM head: score only the tokens of the top-k centroids.

    The vocabulary is split into ``num_centroids`` clusters of ``V / num_centroids`` tokens,
    listed (in canonical token ids) by the ``token_ordering`` buffer. Tokens outside the chosen
    clusters get ``min(selected logits) - 1``. HF takes that min over the whole batch with
    ``.item()`` (a host sync); we take it per row on device. Per row the masked value is still
    below every selected logit, so argmax, ranking and the selected logits are unchanged; only
    the filler value of rows in a multi-row batch can differ from HF's.
    """

    def __init__(self, spec: Gemma4AssistantSpec):
        super().__init__()
        vocab, c = spec.text.vocab_size, spec.num_centroids
        if vocab % c:
            raise ValueError(f"assistant vocab_size {vocab} is not a multiple of num_centroids {c}")
        self.vocab_size, self.num_centroids, self.top_k = vocab, c, spec.centroid_intermediate_top_k
        self.per_centroid = vocab // c
        self.centroids = nn.Linear(spec.text.hidden_size, c, bias=False)
        self.register_buffer("token_ordering", torch.zeros(vocab, dtype=torch.long))

    def forward(self, h: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """h [R, Ha] -> logits [R, V] in h's dtype."""
        r = h.shape[0]
        top = torch.topk(self.centroids(h), k=self.top_k, dim=-1).indices  # [R, k]
        clusters = self.token_ordering.view(self.num_centroids, self.per_centroid)
        sel = clusters[top].reshape(r, self.top_k * self.per_centroid)  # canonical ids [R, k*Vc]
        if tp_size() == 1:
            emb = lm_head_weight[sel]  # [R, k*Vc, Ha]
            picked = (h.unsqueeze(-2) @ emb.transpose(-1, -2)).squeeze(-2)  # [R, k*Vc]
        else:  # the head is vocabulary-split: each rank scores the ids it holds
            picked = vocab_rows_logits(h, lm_head_weight, shard.vocab(self.vocab_size), sel)
        filler = picked.amin(dim=-1, keepdim=True) - 1.0
        out = filler.expand(r, self.vocab_size).contiguous()
        return out.scatter_(-1, sel, picked)


class Gemma4AssistantForCausalLM(CausalLM):
    """Draft model. Call ``bind(target)`` (the loader does) before ``forward``.

    ``hidden_size`` is the size of the hidden it consumes and produces (the target's); the
    assistant's own width is ``draft_hidden_size``. It owns no KV: ``kv_shapes`` is empty.
    """

    def __init__(self, spec: Gemma4AssistantSpec):
        super().__init__()
        text = spec.text
        self.spec = spec
        self.hidden_size = spec.backbone_hidden_size
        self.draft_hidden_size = text.hidden_size
        self.vocab_size = text.vocab_size
        self.tie_word_embeddings = spec.tie_word_embeddings
        self.kv_shapes = []
        self.sliding_windows = tuple(sorted({w for layer in text.layers if (w := layer.sliding_window)}))
        self.model = Gemma4Backbone(text)
        self.lm_head = None if spec.tie_word_embeddings else factory.lm_head(text.hidden_size, text.vocab_size)
        # Replicated at any TP size; ``Linear`` lets their one-row draft GEMMs take the GEMV (a
        # link of the PDL chain in the draft graph, where cuBLAS's split-K pair broke it).
        self.pre_projection = Linear(2 * spec.backbone_hidden_size, text.hidden_size, bias=False)
        self.post_projection = Linear(text.hidden_size, spec.backbone_hidden_size, bias=False)
        self.masked_embedding = Gemma4AssistantMaskedEmbedder(spec) if spec.use_ordered_embeddings else None
        self._target: list = []  # a list, so the target is not registered as a submodule

    # ---- binding to the target --------------------------------------------------------------

    def bind(self, target) -> None:
        """Check the pair fits and point every layer at the target's KV owner of its type."""
        if not hasattr(target, "kv_owner_for_type"):
            raise ValueError(f"the assistant needs a Gemma 4 target, got {type(target).__name__}")
        if self.spec.backbone_hidden_size != target.hidden_size:
            raise ValueError(
                f"draft backbone_hidden_size {self.spec.backbone_hidden_size} does not match "
                f"target hidden_size {target.hidden_size}"
            )
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"draft vocab_size {self.vocab_size} does not match target vocab_size {target.vocab_size}")
        for i, (layer, mod) in enumerate(zip(self.spec.text.layers, self.model.layers)):
            owner = target.kv_owner_for_type(layer.layer_type)
            shape = target.kv_shapes[owner]
            total = target.kv_heads_total[owner]
            if (total, shape.head_dim) != (layer.num_kv_heads, layer.head_dim):
                raise ValueError(
                    f"draft layer {i} ({layer.layer_type}) expects KV heads/head_dim "
                    f"{layer.num_kv_heads}/{layer.head_dim}, the target's layer has "
                    f"{total}/{shape.head_dim}"
                )
            mod.self_attn.attn = AttnLayer(
                kv_layer=owner, sliding_window=layer.sliding_window, scaling=1.0, writes_kv=False
            )
        self._target[:] = [target]

    @property
    def target(self):
        if not self._target:
            raise RuntimeError("Gemma4AssistantForCausalLM.bind(target) has not been called")
        return self._target[0]

    # ---- forward ------------------------------------------------------------------------------

    def optional_weights(self) -> dict[str, float]:
        return self.model.optional_weights()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The draft consumes the target's scaled embedding of its input token."""
        return self.target.embed(ids)

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self, token_embeds: torch.Tensor, prev_hidden: torch.Tensor, fb: ForwardBatch, backend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """token_embeds, prev_hidden [R, Ht] -> (float32 logits [R, V], next_hidden [R, Ht]).

        ``fb`` is a Q-only batch: out_loc None, RoPE positions = the constant draft position,
        metadata built with q_pos = kv_len - 1 so each row sees exactly its committed keys.
        """
        h, next_hidden = self._run(torch.cat([token_embeds, prev_hidden], dim=-1), fb, backend)
        return self.compute_logits(h), next_hidden

    def draft_step(self, tokens: torch.Tensor, prev_hidden: torch.Tensor, fb: ForwardBatch, backend,
                   out: torch.Tensor | None = None, last: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One greedy draft step: ``forward`` on the target's embedding of ``tokens`` [R], then
        the argmax -> (next tokens [R], written into ``out`` when given; next_hidden [R, Ht], or
        None for the ``last`` step of a chain, whose hidden nothing reads: its post-projection
        is skipped). The input row is one kernel (``embed_cat``) and the argmax reads the logits
        in the model dtype: the same index as over their float32 copy, without the copy (three
        launches fewer per step)."""
        h, next_hidden = self._run(self.target.embed_cat(tokens, prev_hidden), fb, backend, hidden=not last)
        return argmax_last(self._logits(h), out), next_hidden

    def _run(self, x: torch.Tensor, fb: ForwardBatch, backend,
             hidden: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pre-projected input [R, 2 Ht] -> (post-norm draft hidden [R, Ha], next_hidden [R, Ht]
        or None without ``hidden``). The input row is in the target's dtype (its embedding and
        hidden); a draft in another dtype (bfloat16 under a float32 target on the CPU) casts it
        to its own, which its norms hold (an FP8 projection's weight is stored in FP8)."""
        h = self.model.run(self.pre_projection(x.to(self.model.norm.weight.dtype)), None, fb, backend)
        return h, self.post_projection(h) if hidden else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Post-norm draft hidden [R, Ha] -> float32 logits [R, V] (no softcap, as HF)."""
        return self._logits(hidden).float()

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.masked_embedding is not None:
            return self.masked_embedding(hidden, self.lm_head_weight())
        return factory.logits(hidden, self.lm_head_weight(), self.vocab_size)

    def init_dummy_(self, seed: int = 0) -> None:
        super().init_dummy_(seed)
        if self.masked_embedding is not None:  # identity ordering: cluster c = ids [c*Vc, (c+1)*Vc)
            self.masked_embedding.token_ordering.copy_(torch.arange(self.vocab_size))
