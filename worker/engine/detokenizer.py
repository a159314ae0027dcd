"""Incremental detokenization with stop strings, one instance per request.

Text is produced with vLLM's prefix/read offset technique: each step decodes a short window
of previous tokens with and without the new token and emits the difference, so leading
spaces (BPE, SentencePiece) come out right and a multi-byte character split over tokens is
held until complete. The window starts in the prompt, so the first output token is decoded
in context. Stop strings are matched in the output text only; text that may still be the
start of a stop string is held back until it is decided. As in vLLM, stop strings are only
checked once the request has min_tokens output tokens.
"""

from __future__ import annotations

from shared.tokenizer import Tokenizer
from worker.engine.core.sampling_params import SamplingParams

# How many prompt tokens precede the first output token in the decode window.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turn sampled token ids into safe-to-emit text deltas.

    `output_text` is all text produced so far, including text held back for stop-string
    matching (after a stop: the final, truncated text). `stop_reason` is the matched stop
    string or None.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = [stop for stop in params.stop if stop]
        self._max_stop_len = max((len(stop) for stop in self._stops), default=0)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_output_tokens = 0
        self._token_ids = self._prompt_context(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._num_emitted = 0
        self.output_text = ""
        self.stop_reason: str | None = None

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The last few prompt tokens, unless they end inside a multi-byte character."""
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            return []
        return context

    @property
    def is_stopped(self) -> bool:
        return self.stop_reason is not None

    def append(self, token_id: int) -> str:
        """Add one sampled token; return the new text that is safe to emit now."""
        if self.is_stopped:
            return ""
        self._token_ids.append(token_id)
        self._num_output_tokens += 1
        return self._accept(self._decode_new(final=False))

    def flush(self) -> str:
        """At the end of generation (length or eos): release everything held back."""
        if self.is_stopped:
            return ""
        delta = self._accept(self._decode_new(final=True))
        if self.is_stopped:
            return delta
        rest = self.output_text[self._num_emitted :]
        self._num_emitted = len(self.output_text)
        return delta + rest

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special)

    def _decode_new(self, final: bool) -> str:
        """Text added by tokens after the read offset ('' while a character is incomplete)."""
        if self._read_offset == len(self._token_ids):
            return ""
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return full_text[len(prefix_text) :]

    def _accept(self, new_text: str) -> str:
        """Append decoded text, check stop strings, return what may be emitted now."""
        if not new_text:
            return ""
        # Without hold-back (below min_tokens) a match may not begin in text already sent.
        floor = 0 if self._include_stop else self._num_emitted
        search_start = max(floor, len(self.output_text) - self._max_stop_len + 1)
        self.output_text += new_text
        if not self._stops or self._num_output_tokens < self._min_tokens:
            # As in vLLM, stop strings are not checked until min_tokens tokens exist.
            return self._emit_until(len(self.output_text))
        stop = self._find_stop(search_start)
        if stop is not None:
            position, stop_string = stop
            end = position + len(stop_string) if self._include_stop else position
            self.output_text = self.output_text[:end]
            self.stop_reason = stop_string
            return self._emit_until(end)
        return self._emit_until(len(self.output_text) - self._num_held_back())

    def _emit_until(self, end: int) -> str:
        start = self._num_emitted
        if end <= start:
            return ""
        self._num_emitted = end
        return self.output_text[start:end]

    def _find_stop(self, search_start: int) -> tuple[int, str] | None:
        """The earliest stop string occurrence at or after `search_start`."""
        best: tuple[int, str] | None = None
        for stop_string in self._stops:
            position = self.output_text.find(stop_string, search_start)
            if position >= 0 and (best is None or position < best[0]):
                best = (position, stop_string)
        return best

    def _num_held_back(self) -> int:
        """Length of the longest text tail that is a proper prefix of some stop string."""
        if self._include_stop:
            # Any match ends after text already seen, so everything before it is kept anyway.
            return 0
        text = self.output_text
        for length in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop_string.startswith(tail) for stop_string in self._stops):
                return length
        return 0
