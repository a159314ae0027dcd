"""Token-id inputs to /v1/embeddings: the model's own ids by default; with
`LLM_EMBEDDING_TOKEN_IDS=cl100k_base`, OpenAI's ids (what LangChain's `OpenAIEmbeddings`
sends), read back as their text and tokenized by the model's tokenizer."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from api.embeddings.inputs import JobOptions
from api.embeddings.jobs import prepare_embedding
from api.embeddings.openai_ids import cl100k_base, ids_to_texts
from api.embeddings.protocol import EmbeddingRequest
from api.errors import APIError
from shared.config import Settings
from shared.contracts import ModelInfo
from shared.tokenizer import Tokenizer
from tests.support.engines import add_tiny_tokenizer

MODEL = ModelInfo(name="embed", source="", max_model_len=64, task="embed", embedding_size=8)
TEXT = "w5 w17 w9"


class _Workers:
    async def resolve(self, name: str | None, default: str, require_live: bool) -> ModelInfo:
        return MODEL


class _Tokenizers:
    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = Tokenizer(AutoTokenizer.from_pretrained(str(path)))

    async def get(self, name: str):  # noqa: ANN201
        return self.tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("word-tokenizer")
    add_tiny_tokenizer(path, vocab_size=64)
    return path


async def _prompts(tokenizer_dir: Path, mode: str, body: dict) -> list[list[int]]:
    services = SimpleNamespace(
        settings=Settings(embedding_token_ids=mode),  # type: ignore[arg-type]
        workers=_Workers(),
        tokenizer=_Tokenizers(tokenizer_dir),
    )
    request = EmbeddingRequest.model_validate({"model": "embed", **body})
    payload = await prepare_embedding(services, request, JobOptions(None, (0, 100)))  # type: ignore[arg-type]
    return payload.prompts


async def test_cl100k_ids_embed_as_their_text(tokenizer_dir: Path) -> None:
    openai_ids = cl100k_base().encode_ordinary(TEXT)
    from_text = await _prompts(tokenizer_dir, "cl100k_base", {"input": TEXT})
    assert await _prompts(tokenizer_dir, "cl100k_base", {"input": [openai_ids]}) == from_text
    assert await _prompts(tokenizer_dir, "model", {"input": [5, 17]}) == [[5, 17]]


def test_cl100k_ids_round_trip_any_text_and_bad_ids_are_400s() -> None:
    text = "héllo wörld, naïve café 🙂\n\ttabs"
    assert ids_to_texts([cl100k_base().encode_ordinary(text)]) == [text]
    for bad in ([10**6], [-1], [100256]):  # past the vocabulary, negative, a gap in it
        with pytest.raises(APIError) as raised:
            ids_to_texts([bad])
        assert raised.value.status == 400 and raised.value.param == "input"
