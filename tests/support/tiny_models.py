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

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")

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


def tiny_config(family: str, **overrides: Any) -> Any:
    """A transformers config for a 2-layer, hidden-64 model of `family`."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    classes = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "mistral": MistralConfig,
    }
    extra: dict[str, Any] = {
        "llama": {"tie_word_embeddings": True},
        "qwen2": {"tie_word_embeddings": False},
        "qwen3": {"head_dim": 32, "tie_word_embeddings": True},
        "mistral": {"sliding_window": None, "tie_word_embeddings": False},
    }[family]
    kwargs = {**_COMMON, **extra, **overrides}
    config = classes[family](**kwargs)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
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
