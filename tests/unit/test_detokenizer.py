"""Incremental detokenization: leading spaces, split UTF-8, stop strings and hold-back."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from shared.tokenizer import Tokenizer
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.detokenizer import IncrementalDetokenizer

CORPUS = [
    "hello world this is a test of the tokenizer",
    "the quick brown fox jumps over the lazy dog",
    "stop here and end now",
]
TEXTS = [
    "hello wörld 😀 日本語 the fox, naïve café",
    "🎉🎉 emoji run 👩‍👩‍👧 family ✓ done",
    "中文混合 English and accents: àéîõü ß",
]


def _sentencepiece_like() -> Tokenizer:
    """A Llama-style BPE: '▁' word marks, byte fallback for non-ASCII, leading space strip."""
    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    raw.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    raw.train_from_iterator(CORPUS * 10, trainer)
    spec = json.loads(raw.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    hf = PreTrainedTokenizerFast(
        tokenizer_object=RawTokenizer.from_str(json.dumps(spec)),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    return Tokenizer(hf)


@pytest.fixture(scope="module")
def sp() -> Tokenizer:
    return _sentencepiece_like()


def run(
    tokenizer: Tokenizer, prompt_ids: list[int], output_ids: list[int], **params: object
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed output ids one by one (stopping like the engine would); deltas include flush."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(**params))
    deltas = []
    for token_id in output_ids:
        deltas.append(detok.append(token_id))
        if detok.stop_reason is not None:
            return deltas, detok
    deltas.append(detok.flush())
    return deltas, detok


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_deltas_equal_decode_in_context(sp: Tokenizer, text: str) -> None:
    prompt_ids = sp.encode("the quick brown fox says", add_special_tokens=False)
    output_ids = sp.encode(text, add_special_tokens=False)
    assert any(sp.hf.convert_ids_to_tokens(i).startswith("<0x") for i in output_ids)
    deltas, detok = run(sp, prompt_ids, output_ids)
    in_context = sp.decode(prompt_ids + output_ids)[len(sp.decode(prompt_ids)) :]
    assert "".join(deltas) == in_context == " " + text  # the first word keeps its space
    assert detok.output_text == in_context
    assert not any("\ufffd" in delta for delta in deltas)
    # without a prompt the result is exactly decode(output ids), leading space stripped
    deltas, _ = run(sp, [], output_ids)
    assert "".join(deltas) == sp.decode(output_ids) == text


def test_multibyte_character_is_held_until_complete(sp: Tokenizer) -> None:
    output_ids = sp.encode("a😀", add_special_tokens=False)[-4:]  # the emoji's four bytes
    assert sp.hf.convert_ids_to_tokens(output_ids) == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    deltas, _ = run(sp, sp.encode("hello"), output_ids)
    assert deltas == ["", "", "", "😀", ""]


def test_flush_releases_an_unfinished_character(sp: Tokenizer) -> None:
    output_ids = sp.encode("hi 😀", add_special_tokens=False)[:-2]
    deltas, detok = run(sp, [], output_ids)
    assert "".join(deltas) == sp.decode(output_ids)
    assert deltas[-1].endswith("\ufffd")


def test_stop_string_straddling_tokens_cuts_exactly(sp: Tokenizer) -> None:
    output_ids = sp.encode("hello world this is a test", add_special_tokens=False)
    pieces = [sp.decode([i]) for i in output_ids]
    assert not any("lo wo" in piece for piece in pieces)
    deltas, detok = run(sp, [], output_ids, stop=["lo wo"])
    assert detok.stop_reason == "lo wo"
    assert "".join(deltas) == detok.output_text == "hel"
    deltas, detok = run(sp, [], output_ids, stop=["lo wo"], include_stop_str_in_output=True)
    assert "".join(deltas) == detok.output_text == "hello wo"
    assert detok.append(output_ids[-1]) == "" and detok.flush() == ""


def test_earliest_stop_wins_and_text_after_is_dropped(sp: Tokenizer) -> None:
    output_ids = sp.encode("the quick brown fox jumps", add_special_tokens=False)
    deltas, detok = run(sp, [], output_ids, stop=["fox", "quick"])
    assert detok.stop_reason == "quick"
    assert "".join(deltas) == "the "


def test_hold_back_never_loses_text(sp: Tokenizer) -> None:
    output_ids = sp.encode("the quick brown fox", add_special_tokens=False)
    detok = IncrementalDetokenizer(sp, [], SamplingParams(stop=["fox jumps", "xyz"]))
    streamed = "".join(detok.append(i) for i in output_ids)
    assert streamed == "the quick brown "  # "fox" could still become "fox jumps"
    assert detok.output_text == "the quick brown fox"
    assert detok.flush() == "fox"
    assert detok.stop_reason is None


def test_stop_strings_wait_for_min_tokens(sp: Tokenizer) -> None:
    output_ids = sp.encode("the fox and the fox jumps", add_special_tokens=False)
    num_first = len(sp.encode("the fox", add_special_tokens=False))
    deltas, detok = run(sp, [], output_ids, stop=["fox"], min_tokens=num_first + 1)
    assert detok.stop_reason == "fox"
    assert "".join(deltas) == detok.output_text == "the fox and the "


def test_stop_in_prompt_is_not_matched(sp: Tokenizer) -> None:
    prompt_ids = sp.encode("stop here", add_special_tokens=False)
    output_ids = sp.encode(" and end now", add_special_tokens=False)
    deltas, detok = run(sp, prompt_ids, output_ids, stop=["here"])
    assert detok.stop_reason is None
    assert "".join(deltas) == sp.decode(prompt_ids + output_ids)[len("stop here") :]


def test_special_tokens_kept_when_asked(sp: Tokenizer) -> None:
    output_ids = sp.encode("hello", add_special_tokens=False) + [2]
    assert "".join(run(sp, [], output_ids)[0]) == "hello"
    kept, _ = run(sp, [], output_ids, skip_special_tokens=False)
    assert "".join(kept) == "hello</s>"


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_deltas_equal_decode(smollm: Tokenizer, text: str) -> None:
    prompt_ids = smollm.apply_chat_template([{"role": "user", "content": "Say something."}])
    output_ids = smollm.encode(text, add_special_tokens=False) + smollm.eos_token_ids
    deltas, detok = run(smollm, prompt_ids, output_ids)
    assert "".join(deltas) == detok.output_text == smollm.decode(output_ids) == text
    assert not any("\ufffd" in delta for delta in deltas)


@pytest.mark.slow
def test_byte_level_stop_inside_emoji_run(smollm: Tokenizer) -> None:
    output_ids = smollm.encode("I like 🎉 parties! The end.", add_special_tokens=False)
    deltas, detok = run(smollm, [], output_ids, stop=["🎉 p"])
    assert "".join(deltas) == detok.output_text == "I like "
    assert detok.stop_reason == "🎉 p"
