"""GGUF tensor names as llama.cpp's converter writes them, and the HF names they stand for.

A tensor of stacked experts (`blk.N.ffn_gate_exps`, [experts, rows, cols]) stands for one HF
tensor per expert (`model.layers.N.mlp.experts.E.gate_proj.weight`).
"""

from __future__ import annotations

import re

from worker.models.errors import ModelConfigError

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors read into the config (Phi-3's LongRoPE factors), not loaded as weights.
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# Gemma's sandwich norms: ffn_norm is the norm before the MLP, and two more after
_GEMMA_BLOCK_NAMES = {
    **BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 keeps gate and up fused, under ffn_up
_PHI3_BLOCK_NAMES = {**BLOCK_NAMES, "ffn_up": "mlp.gate_up_proj"}
_BLOCK_NAMES_BY_ARCH = {
    "gemma2": _GEMMA_BLOCK_NAMES,
    "gemma3_text": _GEMMA_BLOCK_NAMES,
    "phi3": _PHI3_BLOCK_NAMES,
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def is_expert_stack(gguf_name: str) -> bool:
    """True for a tensor holding every expert of a layer ([experts, rows, cols])."""
    match = _BLOCK_RE.fullmatch(gguf_name)
    return match is not None and match.group(2) in EXPERT_NAMES


def hf_name(gguf_name: str, arch: str = "llama", expert: int | None = None) -> str:
    """The HF parameter name for a GGUF tensor name (of a file of transformers' `arch`);
    `expert` picks one expert of a stacked expert tensor."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    names = _BLOCK_NAMES_BY_ARCH.get(arch, BLOCK_NAMES)
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or (match.group(2) not in names and match.group(2) not in EXPERT_NAMES):
        raise ModelConfigError(f"unknown GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    if part in EXPERT_NAMES:
        return f"model.layers.{layer}.mlp.experts.{expert}.{EXPERT_NAMES[part]}.{kind}"
    return f"model.layers.{layer}.{names[part]}.{kind}"
