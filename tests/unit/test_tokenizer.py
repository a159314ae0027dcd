"""Tokenizer wrapper: loading, eos ids, chat templates, token pieces and bytes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from shared.model_files import (
    ModelNotFoundError,
    ModelSource,
    converted_dir,
    installed_root,
)
from shared.tokenizer import Tokenizer, load_tokenizer

TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('roles must be user or assistant') }}{% endif %}"
    "<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
WORDS = ["<unk>", "<s>", "</s>", "\u2581hi", "\u2581there", "<0xE2>", "\u2581user:", "\u2581a\nb"]


def write_tiny_model_dir(directory: Path, chat_template: str | None = TEMPLATE) -> Path:
    """A SentencePiece-style word-level tokenizer saved as an HF directory."""
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    hf.chat_template = chat_template
    hf.save_pretrained(str(directory))
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    return directory


@pytest.fixture()
def tiny(tmp_path: Path) -> Tokenizer:
    return load_tokenizer(str(write_tiny_model_dir(tmp_path)))


def test_hf_dir_attributes_and_generation_eos(tiny: Tokenizer) -> None:
    assert tiny.eos_token_ids == [2, 7]
    assert tiny.bos_token_id == 1
    assert tiny.vocab_size == len(WORDS)
    assert tiny.encode("hi there") == [3, 4]
    assert tiny.decode([3, 4, 2]) == "hi there"
    assert tiny.decode([3, 2], skip_special_tokens=False) == "hi</s>"


def test_sentencepiece_token_text_and_bytes(tiny: Tokenizer) -> None:
    assert tiny.token_bytes(3) == list(b" hi")
    assert tiny.token_text(3) == " hi"
    assert tiny.token_bytes(5) == [0xE2]
    assert tiny.token_text(5) == "\ufffd"
    assert tiny.token_bytes(2) == list(b"</s>")


def test_chat_template_flattens_parts(tiny: Tokenizer) -> None:
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    text = tiny.chat_text([{"role": "user", "content": parts}])
    assert text == "<s>user: hi\nthere</s><s>assistant:"
    ids = tiny.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids == tiny.encode("<s>user: hi</s><s>assistant:", add_special_tokens=False)
    no_prompt = tiny.chat_text([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert no_prompt == "<s>user: hi</s>"


def test_chat_template_errors_are_value_errors(tiny: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="chat template failed: roles must be user or assistant"):
        tiny.apply_chat_template([{"role": "wizard", "content": "hi"}])
    with pytest.raises(ValueError, match="only 'text'"):
        tiny.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ValueError, match="at least one message"):
        tiny.apply_chat_template([])
    bare_dir = write_tiny_model_dir(tmp_path / "bare", chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(str(bare_dir)).apply_chat_template([{"role": "user", "content": "hi"}])


def test_gguf_loads_from_its_converted_dir(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not read when a conversion exists")
    cache = tmp_path / "cache"
    target = converted_dir(ModelSource("gguf", gguf), str(cache))
    target.mkdir(parents=True)
    write_tiny_model_dir(target)
    tokenizer = load_tokenizer(str(gguf), cache_dir=str(cache))
    assert tokenizer.encode("hi there") == [3, 4]
    assert tokenizer.eos_token_ids == [2, 7]  # generation_config.json of the conversion


def test_a_conversion_made_at_install_is_found_with_an_empty_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m worker.prepare` converts into the environment; an empty cache finds it."""
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not read when a conversion exists")
    source, cache = ModelSource("gguf", gguf), str(tmp_path / "empty-cache")
    assert converted_dir(source, cache).is_relative_to(tmp_path / "empty-cache")
    installed = converted_dir(source, root=installed_root())
    assert installed.is_relative_to(tmp_path / "venv" / "share" / "ladle")
    installed.mkdir(parents=True)
    write_tiny_model_dir(installed)
    (installed / "model.safetensors").write_bytes(b"")  # a finished conversion has weights
    assert converted_dir(source, cache) == installed
    assert load_tokenizer(str(gguf), cache_dir=cache).encode("hi there") == [3, 4]


def test_unknown_model_ref(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        load_tokenizer(str(tmp_path / "missing"))


@pytest.mark.slow
def test_smollm_chat_template_matches_transformers(smollm: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4, of course."},
    ]
    expected = smollm.hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if not isinstance(expected, list) else expected
    assert smollm.apply_chat_template(messages) == list(expected)
    assert smollm.eos_token_ids == [2]
    assert smollm.bos_token_id == 1
    assert smollm.vocab_size == 49152


@pytest.mark.slow
def test_smollm_chat_template_error(smollm: Tokenizer) -> None:
    with pytest.raises(ValueError, match="chat template failed"):
        smollm.apply_chat_template([{"role": "user"}])


@pytest.mark.slow
def test_smollm_byte_level_token_bytes(smollm: Tokenizer) -> None:
    text = " héllo 😀 中文 <|im_end|>"
    ids = smollm.encode(text)
    assert b"".join(bytes(smollm.token_bytes(i)) for i in ids).decode() == text
    emoji_ids = smollm.encode("😀")
    assert len(emoji_ids) > 1  # the emoji spans tokens: each piece alone is a partial char
    assert "\ufffd" in smollm.token_text(emoji_ids[0])
    assert smollm.token_text(smollm.encode(" hello")[0]) == " hello"


@pytest.mark.slow
def test_the_plain_class_loads_what_auto_tokenizer_does(smollm: Tokenizer) -> None:
    from transformers import AutoTokenizer

    directory = Path(smollm.hf.name_or_path)
    auto = AutoTokenizer.from_pretrained(str(directory))
    assert type(smollm.hf) is type(auto)
    text = " héllo 😀 中文 <|im_end|> def f(x):\n\treturn x"
    assert smollm.hf(text)["input_ids"] == auto(text)["input_ids"]
    assert smollm.hf.all_special_ids == auto.all_special_ids
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert smollm.apply_chat_template(messages) == list(
        auto.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    )
