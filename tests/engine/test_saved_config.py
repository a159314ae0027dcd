"""A config saved by one start is, to every later one, the config transformers read: the same
attributes and dict, and a model loaded from it computes the same logits. The tokenizer
picked without transformers' config class is the one AutoTokenizer picks with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared import tokenizer as tokenizer_module
from tests.support.tiny_models import FAMILIES, greedy_logits, tiny_model_dir
from worker.models import saved_config
from worker.models.loader import _read_live_config, load_model
from worker.models.saved_config import SavedConfig, plain_attributes, read_config


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_config_has_every_attribute_of_the_live_one(family: str, tmp_path: Path) -> None:
    model_dir = tiny_model_dir(family, tmp_path)
    cache = str(tmp_path / "cache")
    live = read_config(model_dir, cache, lambda: _read_live_config(model_dir))
    saved = read_config(model_dir, cache, lambda: pytest.fail("read live a second time"))
    assert isinstance(saved, SavedConfig) and not isinstance(live, SavedConfig)
    kept, left_out = plain_attributes(live)
    assert kept and {name: getattr(saved, name) for name in kept} == kept
    assert saved.to_dict() == saved_config.json.loads(saved_config.json.dumps(live.to_dict()))
    for name in left_out:
        with pytest.raises(TypeError, match="not saved"):
            getattr(saved, name)
    assert getattr(saved, "no_such_attribute", "default") == "default"


def test_a_changed_config_is_read_live_again(tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama", tmp_path)
    cache = str(tmp_path / "cache")
    read_config(model_dir, cache, lambda: _read_live_config(model_dir))
    path = model_dir / "config.json"
    path.write_text(path.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    again = read_config(model_dir, cache, lambda: _read_live_config(model_dir))
    assert not isinstance(again, SavedConfig) and again.rms_norm_eps == 1e-05


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_moe"])
def test_a_model_from_the_saved_config_computes_the_same_logits(
    family: str, tmp_path: Path
) -> None:
    model_dir = tiny_model_dir(family, tmp_path)
    cache = str(tmp_path / "cache")
    first = load_model(str(model_dir), dtype="float32", device="cpu", cache_dir=cache)
    second = load_model(str(model_dir), dtype="float32", device="cpu", cache_dir=cache)
    assert isinstance(second.hf_config, SavedConfig)
    assert not isinstance(first.hf_config, SavedConfig)
    assert second.max_model_len == first.max_model_len
    assert second.eos_token_ids == first.eos_token_ids
    prompt = [1, 5, 9, 13, 2, 7]
    torch.testing.assert_close(
        greedy_logits(second, False, prompt, 3),
        greedy_logits(first, False, prompt, 3),
        rtol=0,
        atol=0,
    )


def test_the_class_hint_picks_the_tokenizer_autotokenizer_picks() -> None:
    from transformers import AutoTokenizer

    from shared.model_files import DEFAULT_MODEL_NAME, resolve_model

    directory = tokenizer_module._tokenizer_dir(resolve_model(DEFAULT_MODEL_NAME), None)
    if directory is None:
        pytest.skip("the default model is not converted here (`python -m worker.prepare`)")
    hint = tokenizer_module._class_hint(directory)
    assert "config" in hint
    hinted = AutoTokenizer.from_pretrained(str(directory), **hint)
    plain = AutoTokenizer.from_pretrained(str(directory))
    assert type(hinted) is type(plain)
    text = "Hello <|im_end|> wörld\n\t 123"
    assert hinted(text).input_ids == plain(text).input_ids
    messages = [{"role": "user", "content": "Hi"}]
    assert hinted.apply_chat_template(messages, tokenize=False) == plain.apply_chat_template(
        messages, tokenize=False
    )
    assert hinted.all_special_ids == plain.all_special_ids
