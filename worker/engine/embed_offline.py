"""Embeddings and scores without Redis: `Embedder(model).embed(texts)`, `.score(query, docs)`.

The engine is driven to completion in the calling thread, as `offline.LLM` drives the
generator; this is how its speed is measured against sentence-transformers in process
(`loadtest/bench_embeddings.py`).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

from worker.engine.embedding import EmbeddingEngine, EmbeddingOutput, EmbeddingRequest
from worker.models.pooling_loader import load_pooling_model

Input = str | list[int]


class Embedder:
    """An embedding model or cross-encoder with its tokenizer, run in this thread."""

    def __init__(
        self,
        model: str,
        dtype: str = "float32",
        device: str = "cpu",
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        cache_dir: str | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        self.loaded = load_pooling_model(model, dtype=dtype, device=device, cache_dir=cache_dir)
        self.engine = EmbeddingEngine(self.loaded, max_num_batched_tokens, max_num_seqs)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.loaded.weights_dir))
        self._ids = itertools.count()

    def tokenize(self, texts: list[str], truncate: int | None = None) -> list[list[int]]:
        """Token ids with the model's special tokens; `truncate` keeps at most that many
        (-1: the model's context), cut as the tokenizer cuts (its specials stay)."""
        limit = self._limit(truncate)
        encoded = self.tokenizer(texts, truncation=limit is not None, max_length=limit)
        return [list(ids) for ids in encoded["input_ids"]]

    def embed(
        self,
        inputs: Input | list[Input],
        dimensions: int | None = None,
        truncate: int | None = None,
    ) -> torch.Tensor:
        """[N, D] float32 vectors for texts or token-id lists, in input order."""
        items = [inputs] if isinstance(inputs, str) or _is_ids(inputs) else list(inputs)
        texts = [i for i in items if isinstance(i, str)]
        tokenized = iter(self.tokenize(texts, truncate)) if texts else iter([])
        token_lists = [next(tokenized) if isinstance(i, str) else list(i) for i in items]
        requests = [
            EmbeddingRequest(self._next_id(), ids, dimensions=dimensions) for ids in token_lists
        ]
        return torch.stack([o.vector for o in self._run(requests)])  # type: ignore[misc]

    def score(self, query: str, documents: list[str], truncate: int | None = None) -> list[float]:
        """Relevance of each document to `query`: a cross-encoder's score of the pair, or
        the cosine of the two embeddings when the model embeds."""
        if self.loaded.task == "embed":
            vectors = self.embed([query, *documents], truncate=truncate)
            return F.cosine_similarity(vectors[:1], vectors[1:]).tolist()
        limit = self._limit(truncate)
        encoded = self.tokenizer(
            [query] * len(documents), documents, truncation=limit is not None, max_length=limit
        )
        types = encoded.get("token_type_ids")
        requests = [
            EmbeddingRequest(self._next_id(), list(ids), list(types[i]) if types else None)
            for i, ids in enumerate(encoded["input_ids"])
        ]
        return [o.score for o in self._run(requests)]  # type: ignore[misc]

    def _run(self, requests: list[EmbeddingRequest]) -> list[EmbeddingOutput]:
        """Run to completion; longest first, so each step's inputs are of similar lengths
        (attention pads to the longest in the step), as sentence-transformers sorts too."""
        for request in sorted(requests, key=lambda r: -len(r.token_ids)):
            self.engine.add_request(request)
        done: dict[str, EmbeddingOutput] = {}
        while self.engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in self.engine.step())
        return [done[r.request_id] for r in requests]

    def _limit(self, truncate: int | None) -> int | None:
        if truncate is None:
            return None
        return self.loaded.max_model_len if truncate == -1 else min(truncate, 1 << 20)

    def _next_id(self) -> str:
        return f"embed-{next(self._ids)}"


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], int)
