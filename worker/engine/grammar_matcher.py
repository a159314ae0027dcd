"""Constrained decoding: per-request grammar matchers and their token bitmasks.

One `GrammarCompiler` per engine owns llguidance's view of the tokenizer (built once on a
background thread at start, ~1 s for a 49k vocabulary), a cache of compiled matchers keyed
by the grammar's hash (a request gets a deep copy: first use of a schema ~0.5 ms, cached
~0.05 ms), and a thread pool that fills the masks of all constrained rows of a step in
parallel (llguidance releases the GIL). A matcher advances with each accepted token; a
preempted request keeps its output tokens, so its matcher stays in step without a replay.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from shared.grammar import GrammarError, check_grammar, grammar_key
from worker.engine.grammar_tokenizer import ll_tokenizer

logger = logging.getLogger(__name__)

_CACHE_SIZE = 512
_BITS = 32


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size  # the width of its masks (the model's vocabulary)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and nothing may follow (only EOS would be allowed)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())

    @property
    def raw(self) -> Any:
        return self._matcher


class GrammarCompiler:
    """Compiles grammars into matchers (cached by hash) and fills bitmasks in batch."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._vocab_size = vocab_size
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-tokenizer")
        self._tokenizer: Future[Any] = self._pool.submit(
            ll_tokenizer, hf_tokenizer, vocab_size, eos_token_ids
        )

    def matcher(self, grammar: str) -> GrammarMatcher:
        """A fresh matcher at the grammar's start; GrammarError if it does not compile."""
        from llguidance import LLMatcher

        key = grammar_key(grammar)
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is not None:
                self._cache.move_to_end(key)
        if pristine is None:
            check_grammar(grammar)
            pristine = LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
            if pristine.is_error():
                raise GrammarError(pristine.get_error())
            with self._lock:
                self._cache[key] = pristine
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        return GrammarMatcher(pristine.deep_copy(), self._vocab_size)

    def _ll_tokenizer(self) -> Any:
        try:
            return self._tokenizer.result()
        except Exception as exc:  # a tokenizer llguidance cannot read (not a fast tokenizer)
            raise GrammarError(f"structured outputs need a fast tokenizer: {exc}") from exc

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_executor: Any = None
_mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
# Byte value -> the 8 additive biases of its bits (bit set: 0, allowed; clear: -inf).
_BYTE_BIASES = np.array(
    [[0.0 if byte >> bit & 1 else -np.inf for bit in range(8)] for byte in range(256)],
    dtype=np.float32,
)


def fill_bitmask(matchers: list[GrammarMatcher]) -> torch.Tensor:
    """[len(matchers), ceil(V / 32)] int32: bit t of a row set = token t allowed.

    llguidance fills the rows in parallel on its own threads, without the GIL.
    """
    global _executor
    from llguidance import LLExecutor

    num_words = (matchers[0].vocab_size + _BITS - 1) // _BITS
    bitmask = torch.zeros((len(matchers), num_words), dtype=torch.int32)
    if _executor is None:
        _executor = LLExecutor()
    pairs = [(m.raw, row) for row, m in enumerate(matchers)]
    _executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), num_words * 4, len(matchers))
    return bitmask


def start_bitmask(matchers: list[GrammarMatcher]) -> Future[torch.Tensor]:
    """`fill_bitmask` on a background thread: the runner starts it before the forward, so on
    a CPU whose decode forward leaves a core free (or on a GPU) the masks cost nothing."""
    return _mask_thread.submit(fill_bitmask, matchers)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of disallowed tokens in `rows` (others untouched).

    One table lookup per mask byte gives the additive biases (0 or -inf) of its 8 tokens:
    16 rows x 49k tokens in ~4 ms on a loaded 2-core EPYC, against ~25 ms for unpacking the
    bits with torch shifts (measured 2026-11-30, load average 15).
    """
    vocab_size = logits.shape[1]
    biases = _BYTE_BIASES[bitmask.numpy().view(np.uint8)].reshape(len(rows), -1)[:, :vocab_size]
    bias = torch.from_numpy(biases).to(logits.device)
    if len(rows) == logits.shape[0]:
        logits.add_(bias)
    else:
        logits.index_add_(0, torch.tensor(rows, dtype=torch.long, device=logits.device), bias)
