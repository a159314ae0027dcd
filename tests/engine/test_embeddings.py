"""The embedding engine against sentence-transformers on the same weights: encoders (BERT,
XLM-R) with each pooling, a decoder (Qwen3, last token), cross-encoders, float32 and bf16;
batching by tokens, Matryoshka truncation, and the errors a bad input gets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shared.errors import InvalidRequestError
from tests.support.engines import add_tiny_tokenizer
from tests.support.tiny_encoders import (
    TEXTS,
    reference,
    sentence_model_dir,
    tiny_cross_encoder_dir,
    tiny_encoder_dir,
)
from tests.support.tiny_models import tiny_config
from worker.engine.embed_offline import Embedder
from worker.engine.embedding import EmbeddingEngine, EmbeddingRequest, token_bucket
from worker.models.pooling_loader import is_pooling_model, load_pooling_model

MAX_SEQ = 48


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("encoders")


@pytest.fixture(scope="module")
def bert_dir(root: Path) -> Path:
    return tiny_encoder_dir(root, "bert")


def _cosines(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(ours.double(), ref.double())


@pytest.mark.parametrize(
    ("family", "pooling", "normalize"),
    [
        ("bert", "mean", True),
        ("bert", "cls", True),
        ("bert", "max", False),
        ("xlm-roberta", "mean", True),
        ("xlm-roberta", "mean_sqrt_len_tokens", False),
    ],
)
def test_encoder_matches_sentence_transformers(
    root: Path, family: str, pooling: str, normalize: bool
) -> None:
    path = sentence_model_dir(tiny_encoder_dir(root, family), pooling, normalize, MAX_SEQ)
    expected = reference(path).encode(TEXTS, convert_to_tensor=True)
    ours = Embedder(str(path)).embed(TEXTS)
    assert _cosines(ours, expected).min() >= 0.9999
    torch.testing.assert_close(ours, expected, atol=2e-5, rtol=1e-4)
    bf16 = Embedder(str(path), dtype="bfloat16").embed(TEXTS)
    assert _cosines(bf16, expected).min() >= 0.999


def _decoder_dir(root: Path) -> Path:
    from transformers import AutoModel

    from tests.support.tiny_encoders import randomise

    config = tiny_config("qwen3")
    config.architectures = ["Qwen3Model"]
    path = root / "qwen3-embed"
    model = AutoModel.from_config(config)
    randomise(model, 3)
    model.save_pretrained(str(path))
    add_tiny_tokenizer(path)
    # Embedding decoders take plain text: with a chat template sentence-transformers renders
    # every input as a user message first.
    (path / "chat_template.jinja").unlink()
    return sentence_model_dir(path, "lasttoken", True, MAX_SEQ)


def test_decoder_last_token_matches_sentence_transformers(root: Path) -> None:
    path = _decoder_dir(root)
    texts = ["w3 w4 w5", "w10 w11 w12 w13 w14 w15 w16 w17 w18", "w200", "w7 w7 w9 w30 w31"]
    expected = reference(path).encode(texts, convert_to_tensor=True)
    ours = Embedder(str(path)).embed(texts)
    assert _cosines(ours, expected).min() >= 0.9999
    bf16 = Embedder(str(path), dtype="bfloat16").embed(texts)
    assert _cosines(bf16, expected).min() >= 0.999


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_cross_encoder_matches_sentence_transformers(root: Path, family: str) -> None:
    from sentence_transformers import CrossEncoder

    path = tiny_cross_encoder_dir(root, family)
    query, documents = TEXTS[0], TEXTS[1:]
    expected = CrossEncoder(str(path), device="cpu").predict([(query, d) for d in documents])
    embedder = Embedder(str(path))
    assert embedder.loaded.task == "score"
    scores = embedder.score(query, documents)
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), atol=1e-5, rtol=0)
    assert len(set(scores)) == len(scores)  # the head sees each pair, not a constant


def test_an_input_embeds_alike_alone_and_in_a_batch(bert_dir: Path) -> None:
    embedder = Embedder(str(sentence_model_dir(bert_dir, "mean", True, MAX_SEQ)))
    together = embedder.embed(TEXTS)
    for i, text in enumerate(TEXTS):
        torch.testing.assert_close(embedder.embed([text])[0], together[i], atol=1e-6, rtol=0)


def test_short_inputs_share_one_forward_within_the_token_budget(bert_dir: Path) -> None:
    loaded = load_pooling_model(str(sentence_model_dir(bert_dir, "mean", True, MAX_SEQ)), "float32")
    engine = EmbeddingEngine(loaded, max_num_batched_tokens=64, max_num_seqs=256)
    for i in range(40):  # 40 inputs of 5 tokens: 12 fit in 64 tokens
        engine.add_request(EmbeddingRequest(f"r{i}", [2, 10 + i, 11, 12, 3]))
    sizes = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        sizes.append(len(outputs))
        assert sum(o.num_tokens for o in outputs) <= 64
    assert sizes == [12, 12, 12, 4]
    assert engine.counters.num_inputs == 40 and engine.counters.num_tokens == 200


class _PickOne:
    """A thread chooser that always picks 1 thread and keeps what it was told."""

    def __init__(self) -> None:
        self.recorded: list[tuple[str, int]] = []

    def pick(self, kind: str) -> int:
        return 1

    def record(self, kind: str, threads: int, seconds: float) -> None:
        self.recorded.append((kind, threads))


def test_a_step_runs_on_the_thread_count_chosen_for_its_size(
    bert_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = load_pooling_model(str(bert_dir), "float32")
    chooser = _PickOne()
    engine = EmbeddingEngine(loaded, 96, 256, threads=chooser)  # type: ignore[arg-type]
    run, seen = engine.runner.run, []
    monkeypatch.setattr(
        engine.runner, "run", lambda rs: seen.append(torch.get_num_threads()) or run(rs)
    )
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for i in range(3):
            engine.add_request(EmbeddingRequest(f"r{i}", [2, 10 + i, 11, 3]))
        assert len(engine.step()) == 3
    finally:
        torch.set_num_threads(before)
    assert seen == [1] and chooser.recorded == [("tokens<=32", 1)]
    assert [token_bucket(n) for n in (1, 32, 33, 512, 513)] == [32, 32, 128, 512, 2048]


def test_interactive_inputs_run_before_batch_lines(bert_dir: Path) -> None:
    loaded = load_pooling_model(str(bert_dir), "float32")
    engine = EmbeddingEngine(loaded, max_num_batched_tokens=96, max_num_seqs=2)
    engine.add_request(EmbeddingRequest("b0", [2, 7, 3], lane="batch"))
    engine.add_request(EmbeddingRequest("b1", [2, 8, 3], lane="batch"))
    engine.add_request(EmbeddingRequest("i0", [2, 9, 3]))
    assert [o.request_id for o in engine.step()] == ["i0", "b0"]
    engine.abort_request("b1")
    assert not engine.has_unfinished_requests()


def test_too_long_input_is_context_length_exceeded_unless_truncated(bert_dir: Path) -> None:
    path = sentence_model_dir(bert_dir, "mean", True, 16)
    embedder = Embedder(str(path))
    long_text = " ".join(f"w{i}" for i in range(40))
    with pytest.raises(InvalidRequestError) as info:
        embedder.embed([long_text])
    assert info.value.code == "context_length_exceeded" and "16 tokens" in info.value.message
    embedder.engine.waiting.clear()
    expected = reference(path).encode([long_text], convert_to_tensor=True)  # it cuts at 16
    for truncate in (-1, 16):
        ours = embedder.embed([long_text], truncate=truncate)
        assert _cosines(ours, expected).min() >= 0.9999


def test_dimensions_only_where_the_model_truncates(root: Path, bert_dir: Path) -> None:
    plain = Embedder(str(sentence_model_dir(bert_dir, "mean", True, MAX_SEQ)))
    with pytest.raises(InvalidRequestError) as info:
        plain.embed(TEXTS, dimensions=16)
    assert info.value.param == "dimensions"
    base = tiny_encoder_dir(root, "bert", seed=1, matryoshka_dimensions=[16, 32, 64])
    path = sentence_model_dir(base, "mean", True, MAX_SEQ)
    matryoshka = Embedder(str(path))
    ours = matryoshka.embed(TEXTS, dimensions=32)
    expected = reference(path, truncate_dim=32).encode(TEXTS, convert_to_tensor=True)
    assert ours.shape == (len(TEXTS), 32)
    torch.testing.assert_close(ours, F.normalize(expected, dim=-1), atol=2e-5, rtol=1e-4)
    with pytest.raises(InvalidRequestError, match="16, 32, 64"):
        matryoshka.embed(TEXTS, dimensions=20)


def test_token_id_inputs_and_bad_ids(bert_dir: Path) -> None:
    embedder = Embedder(str(bert_dir))
    ids = embedder.tokenize(TEXTS[:2])
    torch.testing.assert_close(embedder.embed(ids), embedder.embed(TEXTS[:2]))
    with pytest.raises(InvalidRequestError, match="token ids"):
        embedder.engine.prepare(EmbeddingRequest("x", [2, 10_000, 3]))
    with pytest.raises(InvalidRequestError, match="empty"):
        embedder.engine.prepare(EmbeddingRequest("y", []))


def test_embedding_models_are_told_from_generators(
    root: Path, bert_dir: Path, tiny_model_dirs: dict[str, Path]
) -> None:
    assert is_pooling_model(str(bert_dir))
    assert is_pooling_model(str(tiny_cross_encoder_dir(root, "bert", seed=2)))
    assert not is_pooling_model(str(tiny_model_dirs["llama"]))


def test_unsupported_sentence_transformers_module_is_named(bert_dir: Path) -> None:
    import json
    import shutil

    path = sentence_model_dir(bert_dir, "mean", True, MAX_SEQ)
    dense = path.parent / "with-dense"
    shutil.copytree(path, dense)
    modules = json.loads((dense / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "x.models.Dense"})
    (dense / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense"):
        load_pooling_model(str(dense))
