"""llguidance's view of a model's fast tokenizer (no torch: tests use it alone)."""

from __future__ import annotations

import copy
import json
from typing import Any


def ll_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """llguidance's view of a fast HF tokenizer (what `llguidance.hf.from_tokenizer` does,
    with non-special added tokens made plain, see `_plain_added_tokens`)."""
    import llguidance

    backend = copy.copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    _plain_added_tokens(spec)
    return llguidance.LLTokenizer(
        json.dumps(spec), n_vocab=vocab_size, eos_token=eos_token_ids or None
    )


def _plain_added_tokens(spec: dict[str, Any]) -> None:
    """Make non-special added ASCII tokens (Qwen's `<tool_call>`) plain text to llguidance.

    llguidance treats every added token as special, so a grammar that spells `<tool_call>`
    could not use that token. They move into the byte-level BPE vocabulary; every added token
    goes there too, under its own id, since the tokenizers library gives an added token that
    is not in the vocabulary the next free id (it shifted `<|im_end|>` and the others by the
    number moved). The special ones stay listed as added, so they stay special."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return
    added = spec.get("added_tokens", [])
    plain = [t for t in added if not t["special"] and _spellable(t["content"])]
    if not plain:
        return
    for token in added:
        model["vocab"].setdefault(token["content"], token["id"])
    spec["added_tokens"] = [t for t in added if t not in plain]


def _spellable(text: str) -> bool:
    return text.isascii() and text.isprintable() and " " not in text
