"""Which model class serves which architecture."""

from __future__ import annotations

from typing import Any

from torch import nn

from worker.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}

MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def resolve_architecture(config: Any) -> str:
    """The supported architecture named by config.architectures or model_type.

    Raises ValueError naming the architecture and listing the supported ones.
    """
    for architecture in getattr(config, "architectures", None) or []:
        if architecture in MODEL_CLASSES:
            return architecture
    named = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    if not named and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    label = ", ".join(named) or f"model_type={model_type!r}"
    raise ValueError(
        f"unsupported model architecture {label}; supported: {', '.join(MODEL_CLASSES)}"
    )


def build_model(config: Any, max_positions: int) -> nn.Module:
    """An uninitialised model for `config` (weights are loaded afterwards)."""
    architecture = resolve_architecture(config)
    return MODEL_CLASSES[architecture](config, architecture, max_positions)
