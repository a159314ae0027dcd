"""An embedding or scoring job's outputs, folded as they come and sent as one result.

Vectors travel as little-endian float32 in base64 (a quarter of JSON floats' size, and
exactly what OpenAI's `encoding_format: base64` returns); scores as floats. Rerank and
score on an embedding model compare the vectors of the pairs the API asked for (cosine).
"""

from __future__ import annotations

import base64

import torch
import torch.nn.functional as F

from shared.contracts import JobPayload, PoolingResult
from worker.engine.embedding import EmbeddingOutput


class PooledOutputs:
    """Every input's output of one job attempt, by input index."""

    def __init__(self, payload: JobPayload) -> None:
        self.payload = payload
        self.outputs: dict[int, EmbeddingOutput] = {}
        self._result: PoolingResult | None = None  # the done event and the record share it

    def add(self, output: EmbeddingOutput) -> None:
        self.outputs[output.index] = output

    def result(self) -> PoolingResult:
        if self._result is None:
            self._result = self._build()
        return self._result

    def _build(self) -> PoolingResult:
        ordered = [self.outputs[i] for i in sorted(self.outputs)]
        if ordered and ordered[0].score is not None:
            return PoolingResult(scores=[o.score for o in ordered], scoring="cross-encoder")
        vectors = torch.stack([o.vector for o in ordered]) if ordered else torch.zeros(0, 0)
        pairs = self.payload.pooling.pairs if self.payload.pooling else None
        if pairs is not None:
            left = vectors[[a for a, _ in pairs]]
            right = vectors[[b for _, b in pairs]]
            scores = F.cosine_similarity(left, right, dim=-1).tolist()
            return PoolingResult(scores=scores, scoring="cosine")
        raw = vectors.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        return PoolingResult(
            dims=int(vectors.shape[-1]), vectors_b64=base64.b64encode(raw).decode()
        )
