"""Per-request sampling parameters (a small dataclass; the runner batches them per step).

The fields mirror the wire contract's `SamplingSpec` one for one (a test keeps them equal),
and their ranges are checked by it: adding a parameter means adding it to `SamplingSpec`,
here, and where it acts (sampler, detokenizer or engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from pydantic import ValidationError

from shared.contracts import SamplingSpec


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those filters.
    `logprobs` is the number of top alternatives to return per token (0: only the
    chosen token's logprob; None: no logprobs). `max_tokens` None means what fits the context.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.validate()
        self.top_k = max(self.top_k, 0)  # -1 (vLLM's "off") is 0 here

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range field.

        The ranges are the wire contract's (`SamplingSpec`), declared there once.
        """
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        try:
            SamplingSpec.model_validate(values)
        except ValidationError as exc:
            first = exc.errors()[0]
            name = ".".join(str(part) for part in first["loc"])
            message = str(first["msg"]).removeprefix("Value error, ")
            raise ValueError(f"{name}: {message}" if name else message) from None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
