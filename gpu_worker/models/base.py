"""The interface every model class exposes to the worker and the loader."""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.kv_pool import KVLayerShape


class CausalLM(nn.Module):
    """A target model. Module names mirror HF's so checkpoint keys load without renaming.

    Subclasses set ``kv_shapes`` (physical KV layers, in pool order), ``sliding_windows`` (the
    distinct windows their layers use, passed to ``backend.build``), ``hidden_size`` and
    ``vocab_size`` in ``__init__``.
    """

    kv_shapes: list[KVLayerShape]
    sliding_windows: tuple[int, ...]
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool

    def forward(self, fb: ForwardBatch, backend) -> torch.Tensor:
        """Flat tokens -> post-final-norm hidden [T, H]."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> logits [R, V]: in the model dtype, or float32 where the model
        softcaps. Consumers that need float32 (softmax, penalties, logprobs) convert."""
        raise NotImplementedError

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> the input embeddings exactly as this model's first layer consumes them."""
        raise NotImplementedError

    # ---- loader hooks -------------------------------------------------------------------

    def checkpoint_key(self, name: str) -> str | None:
        """Our name for a checkpoint tensor, or None to skip it silently (e.g. a vision tower)."""
        return name

    def ignored_checkpoint_key(self, name: str) -> bool:
        """Checkpoint tensors we knowingly drop (HF-only buffers, the tied head)."""
        if name.endswith("rotary_emb.inv_freq") or "rotary_emb." in name:
            return True
        return self.tie_word_embeddings and name == "lm_head.weight"

    def optional_weights(self) -> dict[str, float]:
        """Parameters/buffers that may be absent from a checkpoint, with the fill value to use."""
        return {}

    def init_dummy_(self, seed: int = 0) -> None:
        """Random weights of the right shapes for --load-format dummy: small normal matrices
        (expert stacks too, so a MoE router spreads tokens over the experts), unit norms, scalars
        and scales, zero biases, so logits stay finite. Generated on the weights' own device
        (fast for large models on GPU). FP8 projections are left to the loader
        (``QuantLoad.init_dummy``: random weights, quantized)."""
        gens: dict[torch.device, torch.Generator] = {}
        for name, p in list(self.named_parameters()) + list(self.named_buffers()):
            if not p.is_floating_point() or name.endswith("inv_freq") or p.dtype == torch.float8_e4m3fn:
                continue
            if p.ndim >= 2:
                gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
                p.data.normal_(0.0, 0.02, generator=gen)
            elif "norm" in name or name.endswith(("layer_scalar", "scale")):  # MoE router scales too
                p.data.fill_(1.0)
            else:
                p.data.zero_()
