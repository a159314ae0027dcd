"""A decoder-only causal LM assembled from `worker/layers` blocks, as a family's spec says.

A family file turns its HF config into a `DecoderSpec` (one `LayerSpec` per layer: its
attention, rotary kind and MLP or MoE) and maps its checkpoint names onto ours; this module
does the rest. The residual stream is Llama's: every residual add is fused with the norm after
it (`RMSNorm.with_residual`); Gemma's sandwich norms sit around attention and MLP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.layers import native
from worker.layers.activation import GeluTanhAndMul, SiluAndMul
from worker.layers.embedding import ScaledEmbedding
from worker.layers.linear import Linear
from worker.layers.mlp import GatedMLP
from worker.layers.moe import MoESpec, SparseMoE
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding
from worker.layers.self_attention import AttentionSpec, SelfAttention
from worker.models.native_stack import LayerStack
from worker.models.weights import Weights, load_checkpoint


@dataclass(frozen=True)
class MLPSpec:
    intermediate_size: int
    act: str = "silu"
    bias: bool = False


@dataclass(frozen=True)
class LayerSpec:
    attention: AttentionSpec
    mlp: MLPSpec | MoESpec
    rope: str = "default"  # which of the spec's rotary tables this layer uses


@dataclass(frozen=True)
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    norm_eps: float
    layers: list[LayerSpec]
    rope: dict[str, dict[str, Any]]  # rotary kind -> rope parameters
    head_dim: int
    norm_offset: float = 0.0  # Gemma's (1 + w) norms
    embed_scale: float = 1.0
    tie_word_embeddings: bool = False
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and around the MLP
    final_softcap: float | None = None


def build_mlp(hidden_size: int, spec: MLPSpec | MoESpec) -> nn.Module:
    if isinstance(spec, MoESpec):
        return SparseMoE(hidden_size, spec)
    return GatedMLP(hidden_size, spec.intermediate_size, spec.act, spec.bias)


class DecoderLayer(nn.Module):
    """(previous block's output, stream) -> (output, stream)."""

    def __init__(self, spec: DecoderSpec, layer: LayerSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        size, eps, offset = spec.hidden_size, spec.norm_eps, spec.norm_offset
        self.self_attn = SelfAttention(layer.attention, rotary)
        self.mlp = build_mlp(size, layer.mlp)
        self.input_layernorm = RMSNorm(size, eps, offset)
        self.post_attention_layernorm = RMSNorm(size, eps, offset)
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(size, eps, offset)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm.with_residual(hidden, residual)
        x = self.self_attn(x, positions)
        if not self.sandwich:
            x, residual = self.post_attention_layernorm.with_residual(x, residual)
            return self.mlp(x), residual
        x, residual = self.pre_feedforward_layernorm.with_residual(
            self.post_attention_layernorm(x), residual
        )
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = ScaledEmbedding(spec.vocab_size, spec.hidden_size, spec.embed_scale)
        self.rotary_emb = nn.ModuleDict(
            {
                kind: RotaryEmbedding(p, spec.head_dim, max_positions)
                for kind, p in spec.rope.items()
            }
        )
        self.layers = nn.ModuleList(
            DecoderLayer(spec, layer, self.rotary_emb[layer.rope]) for layer in spec.layers
        )
        self.norm = RMSNorm(spec.hidden_size, spec.norm_eps, spec.norm_offset)
        self.native_layers = LayerStack()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = torch.zeros_like(hidden)  # x + 0 is x: every layer has one signature
        stack = self.native_layers.for_step(self.layers, hidden.shape[0])
        if stack is not None:
            hidden, residual = stack.forward(hidden, residual, positions)
        else:
            for layer in self.layers:
                hidden, residual = layer(hidden, residual, positions)
        return self.norm.with_residual(hidden, residual)[0]


class DecoderForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T]) -> hidden [T, H]; compute_logits -> float32
    (or the model's dtype, asked for).

    A family subclasses it with `spec_for(config, architecture)` and, where its checkpoint
    names differ from ours, `checkpoint_name`."""

    spec_for: Callable[[Any, str], DecoderSpec]

    def __init__(self, config: Any, architecture: str, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.spec = type(self).spec_for(config, architecture)
        self.model = DecoderModel(self.spec, max_positions)
        self.lm_head = Linear(self.spec.hidden_size, self.spec.vocab_size, bias=False)
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def checkpoint_name(self, name: str) -> str | None:
        """Our parameter name for a checkpoint tensor (None: not loaded)."""
        if name == "lm_head.weight" and self.spec.tie_word_embeddings:
            return None
        return name

    def use_native(self, enabled: bool) -> bool:
        """Norms, SiLU/GELU-mul and rotary on the native kernels from now on where they apply
        (CPU, bf16 or float32, the kernels for it loaded; each block also checks its own
        form); returns whether they do. Chosen once, at load."""
        chosen = (
            enabled
            and native.serves(self.lm_head.weight)
            and native.serves(self.model.embed_tokens.weight)
            and self.spec.head_dim % 2 == 0
        )
        for module in self.modules():
            if isinstance(module, (RMSNorm, SiluAndMul, GeluTanhAndMul, RotaryEmbedding)):
                module.use_native(chosen)
        return chosen

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """Float32 logits [N, vocab] (soft-capped where the family does, as Gemma 2); with
        `widen` False, uncapped logits stay in the model's dtype (a greedy step's argmax is the
        same on them, without a float32 copy)."""
        logits = self.lm_head(hidden)
        cap = self.spec.final_softcap
        if cap is None:
            return logits.float() if widen else logits
        # in place on the fresh float32 logits: HF's divide, tanh, multiply, no copies
        return logits.float().div_(cap).tanh_().mul_(cap)

    def post_load(self) -> None:
        for rotary in self.model.rotary_emb.values():
            rotary.build_cache()

    def load_weights(self, weights: Weights) -> set[str]:
        if self.spec.tie_word_embeddings:  # moving off the meta device unties parameters
            self.lm_head.weight = self.model.embed_tokens.weight
        return load_checkpoint(self, weights, self.checkpoint_name)
