"""Whether a grammar allows a text, through llguidance with the byte-level test tokenizer
(which spells anything) viewed as the worker views it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.support.tiny_bytes import MODEL_VOCAB, add_byte_tokenizer


def byte_acceptor(directory: Path) -> Callable[[str, str], bool]:
    """accepts(grammar, text): the grammar allows every token of `text` (encoded as the
    tokenizer does, so `<tool_call>` is its own token)."""
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    from worker.engine.grammar_tokenizer import ll_tokenizer

    add_byte_tokenizer(directory)
    hf = AutoTokenizer.from_pretrained(str(directory))
    view = ll_tokenizer(hf, MODEL_VOCAB, [hf.eos_token_id])

    def accepts(grammar: str, text: str) -> bool:
        ids = hf.encode(text, add_special_tokens=False)
        return LLMatcher(view, grammar).validate_tokens(ids) == len(ids)

    return accepts
