"""Which model class serves which architecture."""

from __future__ import annotations

from typing import Any

from torch import nn

from worker.models.bert import BertEncoderModel
from worker.models.decoder_embedding import CAUSAL_NAMES, DecoderEmbeddingModel
from worker.models.errors import ModelConfigError
from worker.models.gemma import GemmaForCausalLM
from worker.models.llama import LlamaForCausalLM
from worker.models.moe import MoEForCausalLM
from worker.models.phi3 import Phi3ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MoEForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
    "OlmoeForCausalLM": MoEForCausalLM,
}

MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}


def resolve_architecture(config: Any) -> str:
    """The supported architecture named by config.architectures or model_type (a config
    object or config.json's dict).

    Raises `ModelConfigError` naming the architecture and listing the supported ones; for a
    checkpoint whose code lives in its repository (`auto_map`), saying so.
    """
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    named = list(get("architectures") or [])
    for architecture in named:
        if architecture in MODEL_CLASSES:
            return architecture
    model_type = get("model_type")
    if not named and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    label = ", ".join(named) or f"model_type={model_type!r}"
    supported = ", ".join(MODEL_CLASSES)
    if get("auto_map"):
        raise ModelConfigError(
            f"model architecture {label} needs its own remote code (auto_map), which Ladle "
            f"does not run; supported: {supported}"
        )
    raise ModelConfigError(f"unsupported model architecture {label}; supported: {supported}")


def build_model(config: Any, max_positions: int) -> nn.Module:
    """An uninitialised model for `config` (weights are loaded afterwards)."""
    architecture = resolve_architecture(config)
    return MODEL_CLASSES[architecture](config, architecture, max_positions)


# Models run for vectors or scores (embedding and cross-encoder workers), no KV cache.
POOLING_CLASSES: dict[str, type[nn.Module]] = {
    "BertModel": BertEncoderModel,
    "RobertaModel": BertEncoderModel,
    "XLMRobertaModel": BertEncoderModel,
    "BertForSequenceClassification": BertEncoderModel,
    "RobertaForSequenceClassification": BertEncoderModel,
    "XLMRobertaForSequenceClassification": BertEncoderModel,
    **{name: DecoderEmbeddingModel for name in CAUSAL_NAMES},
}

POOLING_MODEL_TYPES = {
    "bert": "BertModel",
    "roberta": "RobertaModel",
    "xlm-roberta": "XLMRobertaModel",
}


def pooling_architecture(config: Any, is_sentence_transformers: bool) -> str | None:
    """The pooling architecture `config` names, or None for a generative model.

    A causal LM of the Llama family packaged for sentence-transformers (Qwen3-Embedding
    ships as `Qwen3ForCausalLM`) is run as its bare decoder.
    """
    named = list(getattr(config, "architectures", None) or [])
    for architecture in named:
        if architecture in POOLING_CLASSES:
            return architecture
        bare = architecture.replace("ForCausalLM", "Model")
        if is_sentence_transformers and bare in CAUSAL_NAMES:
            return bare
    if not named:
        return POOLING_MODEL_TYPES.get(getattr(config, "model_type", None))
    return None


def build_pooling_model(config: Any, architecture: str, max_positions: int) -> nn.Module:
    """An uninitialised embedding or cross-encoder model (weights are loaded afterwards)."""
    return POOLING_CLASSES[architecture](config, architecture, max_positions)
