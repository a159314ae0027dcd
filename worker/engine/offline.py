"""Offline use without Redis: `LLM(...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from worker.engine.config import EngineConfig
from worker.engine.core.outputs import SampledToken
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.engine import LLMEngine, SequenceOutput

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[SampledToken] | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    usage: Usage = field(default_factory=Usage)
    first_token_time: float | None = None
    finished_time: float | None = None


class LLM:
    """The engine driven to completion in the calling thread."""

    def __init__(
        self, config: EngineConfig | None = None, engine: LLMEngine | None = None, **overrides: Any
    ) -> None:
        if engine is None:
            config = config or EngineConfig()
            for key, value in overrides.items():
                setattr(config, key, value)
            engine = LLMEngine(config)
        self.engine = engine
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        priorities: list[int] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (text or token ids); results in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        token_lists = [self.engine.tokenize(prompt=p) for p in prompt_list]
        return self._run(token_lists, sampling_params, priorities)

    def chat(
        self,
        conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        token_lists = [self.engine.tokenize(messages=c) for c in conversations]  # type: ignore[arg-type]
        return self._run(token_lists, sampling_params, None)

    def _run(
        self,
        token_lists: list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None,
        priorities: list[int] | None,
    ) -> list[GenerationResult]:
        params_list = _broadcast(sampling_params or SamplingParams(), len(token_lists))
        results: dict[str, GenerationResult] = {}
        for i, (tokens, params) in enumerate(zip(token_lists, params_list, strict=True)):
            request_id = f"offline-{next(self._ids)}"
            prepared = self.engine.prepare(
                request_id, tokens, params, priorities[i] if priorities else 0
            )
            self.engine.add_request(prepared)
            outputs = [CompletionOutput(index=j) for j in range(params.n)]
            results[request_id] = GenerationResult(
                request_id, tokens, outputs, Usage(prompt_tokens=len(tokens))
            )
        while self.engine.has_unfinished_requests():
            for seq_output in self.engine.step():
                _accumulate(results[seq_output.request_id], seq_output)
        return list(results.values())


def _accumulate(result: GenerationResult, seq: SequenceOutput) -> None:
    now = time.perf_counter()
    output = result.outputs[seq.index]
    output.text += seq.new_text
    output.token_ids.extend(seq.new_token_ids)
    if seq.new_logprobs is not None:
        output.logprobs = (output.logprobs or []) + seq.new_logprobs
    result.usage.completion_tokens += len(seq.new_token_ids)
    result.usage.cached_tokens = max(result.usage.cached_tokens, seq.num_cached_tokens)
    result.first_token_time = result.first_token_time or now
    if seq.finished:
        output.finish_reason = seq.finish_reason
        result.finished_time = now


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _broadcast(params: SamplingParams | list[SamplingParams], count: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return list(params)


def generate(
    prompts: Prompt | list[Prompt],
    sampling_params: SamplingParams | list[SamplingParams] | None = None,
    **config: Any,
) -> list[GenerationResult]:
    """One-shot convenience: build an engine from keyword settings and generate."""
    return LLM(EngineConfig(**config)).generate(prompts, sampling_params)
