"""The Llama family: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm).

Parameter names follow Hugging Face checkpoints, except that q/k/v and gate/up are fused
(`qkv_proj`, `gate_up_proj`); `load_weights` packs checkpoint tensors into them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.layers import native
from worker.layers.activation import SiluAndMul
from worker.layers.attention import PagedAttention
from worker.layers.embedding import CheckpointEmbedding
from worker.layers.linear import Linear, PackedLinear
from worker.layers.norm import RMSNorm
from worker.layers.quant import QuantizedTensor
from worker.layers.rotary import RotaryEmbedding, rope_parameters
from worker.models.hf_config import head_dim_of, layer_window
from worker.models.native_stack import LayerStack
from worker.models.weights import load_checkpoint


@dataclass(frozen=True)
class LlamaVariant:
    """What differs between members of the family."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: bool = True  # Mistral and Qwen honour the config's window; Llama does not


def variant_for(architecture: str, config: Any) -> LlamaVariant:
    attention_bias = bool(getattr(config, "attention_bias", False))
    if architecture == "Qwen2ForCausalLM":
        return LlamaVariant(qkv_bias=True)
    if architecture == "Qwen3ForCausalLM":
        return LlamaVariant(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
    return LlamaVariant(
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        sliding_window=architecture != "LlamaForCausalLM",
    )


class LlamaAttention(nn.Module):
    def __init__(
        self, config: Any, variant: LlamaVariant, rotary: RotaryEmbedding, index: int
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(
            config.hidden_size, [q_size, kv_size, kv_size], bias=variant.qkv_bias
        )
        self.o_proj = Linear(q_size, config.hidden_size, bias=variant.o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if variant.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if variant.qk_norm else None
        window = layer_window(config, index) if variant.sliding_window else None
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, window
        )
        self._rotary = [rotary]  # shared by every layer; a list keeps it out of the submodules

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(num_tokens, -1, self.head_dim)
        num_qk = self.num_heads + self.num_kv_heads
        rotary = self._rotary[0]
        if self.q_norm is None:
            # q and k heads side by side: one rotary over both
            qk = rotary.rotate(qkv, num_qk, positions)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:
            q = rotary.rotate(self.q_norm(qkv[:, : self.num_heads]), self.num_heads, positions)
            k_heads = self.k_norm(qkv[:, self.num_heads : num_qk])
            k = rotary.rotate(k_heads, self.num_kv_heads, positions)
        out = self.attn(q, k, qkv[:, num_qk:])
        return self.o_proj(out.view(num_tokens, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, variant: LlamaVariant) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = PackedLinear(config.hidden_size, [size, size], bias=variant.mlp_bias)
        self.down_proj = Linear(size, config.hidden_size, bias=variant.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """One block of the residual stream: (previous block's output, stream) -> (output, stream).

    Each residual add is fused with the norm after it (`RMSNorm.with_residual`), so on the
    native kernels a layer is 10 calls, 5 of them matmuls; eagerly the same adds and norms."""

    def __init__(
        self, config: Any, variant: LlamaVariant, rotary: RotaryEmbedding, index: int
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, variant, rotary, index)
        self.mlp = LlamaMLP(config, variant)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm.with_residual(hidden, residual)
        x = self.self_attn(x, positions)
        x, residual = self.post_attention_layernorm.with_residual(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, variant: LlamaVariant, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = CheckpointEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            rope_parameters(config), head_dim_of(config), max_positions
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, variant, self.rotary_emb, index)
            for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.variant = variant
        self.native_layers = LayerStack()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # the stream starts at zero, so every layer has one signature (one compiled graph);
        # x + 0 is x exactly
        residual = torch.zeros_like(hidden)
        stack = self.native_layers.for_step(self.layers, hidden.shape[0])
        if stack is not None:  # the same ops as the loop below, in one native call
            hidden, residual = stack.forward(hidden, residual, positions)
        else:
            for layer in self.layers:
                hidden, residual = layer(hidden, residual, positions)
        return self.norm.with_residual(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T]) -> hidden [T, H]; compute_logits -> float32 logits."""

    def __init__(self, config: Any, architecture: str, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, variant_for(architecture, config), max_positions)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def use_native(self, enabled: bool) -> bool:
        """Run the norms, SiLU-mul and rotary on the native kernels from now on where they
        apply (CPU, bf16 or float32 weights, the kernels for them loaded); returns whether
        they do. Chosen once, at load: the forward is the same either way."""
        chosen = (
            enabled
            and native.serves(self.lm_head.weight)
            and native.serves(self.model.embed_tokens.weight)
            and head_dim_of(self.config) % 2 == 0
        )
        for module in self.modules():
            if isinstance(module, (RMSNorm, SiluAndMul, RotaryEmbedding)):
                module.use_native(chosen)
        return chosen

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """Float32 logits [N, vocab] for the selected hidden states [N, H] (`widen` False:
        in the model's dtype, for a sampler that widens them only where it needs to).

        The product runs in the model's dtype and is widened after, as vLLM does: a float32
        copy of a bf16 head made this matmul 4x slower (a third of a 64-sequence decode step).
        """
        logits = self.lm_head(hidden)
        return logits.float() if widen else logits

    def post_load(self) -> None:
        """Build what is derived from config rather than loaded (rotary cache)."""
        self.model.rotary_emb.build_cache()

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]
    ) -> set[str]:
        """Copy checkpoint tensors (HF names) into parameters; returns the names loaded.

        A `QuantizedTensor` (a linear's weight from a quantized GGUF) is handed to its layer,
        which packs it at `quantize_linears`.
        """
        if self.tie_word_embeddings:  # moving off the meta device unties parameters
            self.lm_head.weight = self.model.embed_tokens.weight
        tied = self.tie_word_embeddings
        return load_checkpoint(
            self, weights, lambda n: None if tied and n == "lm_head.weight" else n
        )
