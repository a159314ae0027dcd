"""Tiny random models saved as HF directories, and helpers to drive the ModelRunner by hand.

Other engine tests may import these (ArgmaxSampler, tiny_model_dir, ManualBatch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from worker.engine.core.outputs import SampledToken, ScheduledChunk, SchedulerOutput
from worker.engine.core.request import Request
from worker.engine.core.sampling_params import SamplingParams

FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma2",
    "gemma3",
    "phi3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
)

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# Small windows and soft-caps, so that the tests' prompts (up to 40 tokens) reach past them.
_GEMMA = dict(
    head_dim=16, query_pre_attn_scalar=16, sliding_window=8, hidden_activation="gelu_pytorch_tanh"
)
_EXTRA: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": True},
    "qwen2": {"tie_word_embeddings": False},
    "qwen3": {"head_dim": 32, "tie_word_embeddings": True},
    "mistral": {"sliding_window": None, "tie_word_embeddings": False},
    "gemma2": {**_GEMMA, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0},
    "gemma3": {
        **_GEMMA,
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
    },
    "phi3": {
        "original_max_position_embeddings": 128,  # the tests' sequences stay within it
        "partial_rotary_factor": 0.5,  # Phi-4-mini rotates part of each head
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.6],
            "long_factor": [1.5, 2.0, 3.0, 4.0],
        },
        "tie_word_embeddings": False,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "mlp_only_layers": [1],
        "tie_word_embeddings": False,
    },
    "qwen3_moe": {
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 0.5},
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}


def _config_class(family: str) -> Any:
    import transformers

    name = {"gemma3": "Gemma3TextConfig"}.get(family)
    if name is None:
        name = ARCHITECTURES[family].replace("ForCausalLM", "Config")
    return getattr(transformers, name)


def tiny_config(family: str, **overrides: Any) -> Any:
    """A transformers config for a 2-layer (Gemma 3: 3), hidden-64 model of `family`."""
    kwargs = {**_COMMON, **_EXTRA[family], **overrides}
    config = _config_class(family)(**kwargs)
    config.architectures = [ARCHITECTURES[family]]
    return config


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Larger-than-default random weights (and non-trivial norms and biases)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.08 * noise)


def tiny_model_dir(family: str, root: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random tiny transformers model of `family` as an HF directory under `root`."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, seed)
    path = root / f"tiny-{family}-{seed}"
    model.save_pretrained(str(path))
    return path


def reference_model(model_dir: Path) -> Any:
    """transformers' own model for the same directory, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


class ArgmaxSampler:
    """Greedy test double with the Sampler interface."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def begin(self, requests: list[Request]) -> None:
        pass

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        assert logits.dtype == torch.float32 and logits.shape[0] == len(requests)
        return [SampledToken(token_id=int(t)) for t in logits.argmax(dim=-1).tolist()]

    def rewind(self, request_id: str, num_rows: int) -> None:
        """Nothing to undo: argmax draws no random numbers."""

    def release(self, request_ids: list[str]) -> None:
        self.released += request_ids


def make_request(request_id: str, prompt: list[int], max_tokens: int = 64) -> Request:
    return Request(request_id, list(prompt), SamplingParams(temperature=0.0), max_tokens)


class ManualBatch:
    """Stands in for the scheduler: hands out block ids and builds chunks by hand."""

    def __init__(self, block_size: int, block_ids: list[int]) -> None:
        self.block_size = block_size
        self.free = list(block_ids)
        self.tables: dict[str, list[int]] = {}

    def chunk(self, request: Request, num_tokens: int) -> ScheduledChunk:
        """The next `num_tokens` of `request`, growing its block table as needed."""
        table = self.tables.setdefault(request.request_id, [])
        end = request.num_computed_tokens + num_tokens
        while len(table) * self.block_size < end:
            table.append(self.free.pop(0))
        return ScheduledChunk(
            request=request,
            start_position=request.num_computed_tokens,
            num_tokens=num_tokens,
            block_ids=list(table),
            is_sampling=end == request.num_tokens,
        )

    def step(self, chunks: list[ScheduledChunk]) -> SchedulerOutput:
        """A SchedulerOutput for `chunks`; advances each request's computed tokens."""
        for chunk in chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens
        return SchedulerOutput(chunks=chunks)


def greedy_logits(loaded: Any, use_native: bool, prompt: list[int], steps: int) -> torch.Tensor:
    """Prefill, then greedy decode steps on a runner; logits of every step [1 + steps, vocab]."""
    from worker.engine.model_runner import ModelRunner

    runner = ModelRunner(loaded, 32, 16, ArgmaxSampler(), native_forward=use_native)
    assert runner.native_forward == use_native
    batch = ManualBatch(16, list(range(32)))
    request = make_request("r", prompt)
    out = [runner.compute_logits(batch.step([batch.chunk(request, request.num_tokens)]))]
    for _ in range(steps):
        request.append_output_token(int(out[-1][0].argmax()))
        out.append(runner.compute_logits(batch.step([batch.chunk(request, 1)])))
    return torch.cat(out)
