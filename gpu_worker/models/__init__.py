"""Model registry: HF ``architectures[0]`` -> our model class.

Load models with ``gpu_worker.models.loader.load_model``; this module only names the classes.
"""

from __future__ import annotations

from gpu_worker.models.gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from gpu_worker.models.gemma4_assistant import Gemma4AssistantForCausalLM
from gpu_worker.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,  # served text-only
    "Gemma4AssistantForCausalLM": Gemma4AssistantForCausalLM,
}

DRAFT_ARCHITECTURES = frozenset({"Gemma4AssistantForCausalLM"})


def model_class(architecture: str) -> type:
    cls = MODEL_REGISTRY.get(architecture)
    if cls is None:
        raise ValueError(
            f"architecture {architecture!r} is not supported (supported: {', '.join(sorted(MODEL_REGISTRY))})"
        )
    return cls


__all__ = ["DRAFT_ARCHITECTURES", "MODEL_REGISTRY", "model_class"]
