"""A thin wrapper over a transformers tokenizer: encoding, chat templates, token pieces.

No torch here: the API uses it to count tokens and render chat templates, the worker to
detokenize. Tokenizers come from a local HF directory or a GGUF file (never a hub name).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from shared.model_files import ModelSource, converted_dir, resolve_model

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPIECE_SPACE = "\u2581"


def load_tokenizer(model_ref: str, cache_dir: str | None = None) -> Tokenizer:
    """Load the tokenizer of a model reference (default name, HF directory or .gguf file).

    A GGUF whose one-time conversion directory already holds tokenizer files loads from there
    (fast); otherwise transformers reads the tokenizer out of the GGUF itself (slow).
    """
    source = resolve_model(model_ref, cache_dir)
    directory = _tokenizer_dir(source, cache_dir)
    backend = _plain_backend(directory)
    if backend is not None:
        hf = backend.from_pretrained(str(directory))
    else:
        from transformers import AutoTokenizer

        if directory is not None:
            hf = AutoTokenizer.from_pretrained(str(directory), **_class_hint(directory))
        else:
            hf = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    return Tokenizer(hf, extra_eos_token_ids=_generation_eos_ids(directory))


def _plain_backend(directory: Path | None) -> Any:
    """transformers' plain `tokenizers` class where tokenizer_config.json names it (as every
    GGUF's conversion does): importing it alone skips AutoTokenizer's scan of transformers'
    1,100 model modules (~1 s of a start). None: let AutoTokenizer choose."""
    if directory is None:
        return None
    try:
        named = json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    if named not in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return None
    try:  # transformers 5's module; older layouts go through AutoTokenizer
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    return TokenizersBackend


def _class_hint(directory: Path) -> dict[str, Any]:
    """AutoTokenizer reads the model's config only to pick the tokenizer class, and loading
    transformers' config class costs ~1 s (it imports torch.distributed's tensor ops). Where
    tokenizer_config.json names the class and neither file asks for remote code, the fields
    it reads from that config are handed over instead ({}: let it read the config)."""
    try:
        tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
        model_config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(tokenizer_config, dict) or not isinstance(model_config, dict):
        return {}
    named = tokenizer_config.get("tokenizer_class") and model_config.get("model_type")
    if not named or "auto_map" in tokenizer_config or "auto_map" in model_config:
        return {}
    hint = SimpleNamespace(
        model_type=model_config["model_type"],
        tokenizer_class=model_config.get("tokenizer_class"),
        _name_or_path=str(directory),
    )
    return {"config": hint}


def _tokenizer_dir(source: ModelSource, cache_dir: str | None) -> Path | None:
    """The HF-style directory to load from, or None to read the GGUF directly."""
    if source.kind == "hf_dir":
        return source.path
    converted = converted_dir(source, cache_dir)
    if (converted / "tokenizer.json").exists() or (converted / "tokenizer_config.json").exists():
        return converted
    return None


def _generation_eos_ids(directory: Path | None) -> list[int]:
    """The eos ids listed in generation_config.json (int or list), if the file exists."""
    if directory is None or not (directory / "generation_config.json").exists():
        return []
    try:
        config = json.loads((directory / "generation_config.json").read_text())
    except (OSError, ValueError):
        return []
    eos = config.get("eos_token_id")
    if isinstance(eos, int):
        return [eos]
    if isinstance(eos, list):
        return [int(token_id) for token_id in eos]
    return []


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE characters back to raw bytes."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


_BYTE_LEVEL_DECODER = _byte_decoder()


class Tokenizer:
    """Encode, decode, render chat templates and describe single tokens.

    Attributes: `eos_token_ids` (tokenizer eos plus generation_config eos ids),
    `bos_token_id`, `vocab_size` (including added tokens), `model_max_length`, `hf`.
    """

    def __init__(self, hf: Any, extra_eos_token_ids: list[int] | None = None) -> None:
        self.hf = hf
        eos_ids = [hf.eos_token_id] if hf.eos_token_id is not None else []
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_ids + (extra_eos_token_ids or [])))
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size: int = len(hf)
        self.model_max_length: int = hf.model_max_length
        self._special_ids = frozenset(hf.all_special_ids)
        self._added_ids = frozenset(hf.get_added_vocab().values())
        self._is_byte_level = _has_byte_level_decoder(hf)
        self.token_bytes = lru_cache(maxsize=65536)(self._token_bytes)  # type: ignore[method-assign]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def chat_text(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the tokenizer's chat template; ValueError when it cannot."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
        if not messages:
            raise ValueError("messages must contain at least one message")
        flat = [_flatten_message(message) for message in messages]
        try:
            return self.hf.apply_chat_template(
                flat, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as exc:  # jinja errors, raise_exception() in templates, bad roles
            raise ValueError(f"chat template failed: {exc}") from exc

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered conversation (special tokens come from the template)."""
        text = self.chat_text(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """The token's own text (a partial UTF-8 character shows as U+FFFD)."""
        return bytes(self.token_bytes(token_id)).decode("utf-8", errors="replace")

    def _token_bytes(self, token_id: int) -> list[int]:
        """UTF-8 bytes of one token, undoing byte-level BPE or SentencePiece markers."""
        piece = self.hf.convert_ids_to_tokens(token_id)
        if piece is None:
            return []
        if token_id in self._added_ids or token_id in self._special_ids:
            return list(piece.encode("utf-8"))
        if self._is_byte_level:
            if all(char in _BYTE_LEVEL_DECODER for char in piece):
                return [_BYTE_LEVEL_DECODER[char] for char in piece]
            return list(piece.encode("utf-8"))
        match = _BYTE_FALLBACK.match(piece)
        if match:
            return [int(match.group(1), 16)]
        return list(piece.replace(_SPIECE_SPACE, " ").encode("utf-8"))


def _has_byte_level_decoder(hf: Any) -> bool:
    backend = getattr(hf, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def _flatten_message(message: dict) -> dict:
    """Turn list-of-parts content into plain text; explicit None content into ''."""
    content = message.get("content")
    if "content" in message and content is None:
        return {**message, "content": ""}
    if content is None or isinstance(content, str):
        return message
    if not isinstance(content, list):
        raise ValueError("message content must be a string or a list of content parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"unsupported content part type {kind!r}: only 'text' is supported")
        texts.append(str(part.get("text", "")))
    return {**message, "content": "\n".join(texts)}
