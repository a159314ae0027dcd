"""One source of truth for request parameters: the wire contract's `SamplingSpec`.

These fail when a parameter exists on one side only (HTTP models, contract, engine) or when
a range is enforced on one side and not the other.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ValidationError

from api.openai.prompting import sampling_spec
from api.openai.protocol import REQUEST_FIELDS, ChatCompletionRequest, CompletionRequest
from shared.contracts import JobPayload, SamplingSpec
from worker.engine.core.sampling_params import SamplingParams

SPEC_FIELDS = set(SamplingSpec.model_fields)
HTTP_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest)
CHAT = {"messages": [{"role": "user", "content": "x"}]}
PROMPT = {"prompt": "x"}


def test_the_engine_has_exactly_the_contracts_parameters_and_defaults() -> None:
    engine = {f.name: f for f in dataclasses.fields(SamplingParams)}
    assert set(engine) == SPEC_FIELDS
    defaults = SamplingParams()
    for name, info in SamplingSpec.model_fields.items():
        assert getattr(defaults, name) == info.get_default(call_default_factory=True), name


@pytest.mark.parametrize("model", HTTP_MODELS, ids=lambda m: m.__name__)
def test_every_http_field_is_a_parameter_or_a_mapped_request_field(model: type) -> None:
    fields = set(model.model_fields)
    assert SPEC_FIELDS <= fields  # every parameter reaches the HTTP surface
    assert fields - SPEC_FIELDS <= REQUEST_FIELDS  # nothing else slips in unmapped


def test_request_fields_are_mapped_somewhere() -> None:
    """A name in REQUEST_FIELDS is a field of an HTTP model, and the job-level ones reach
    the payload (the rest shape the prompt's tokenization or the response)."""
    http = set().union(*(m.model_fields for m in HTTP_MODELS))
    assert REQUEST_FIELDS <= http
    assert {"model", "stream", "priority", "prompt", "echo", "messages"} <= set(
        JobPayload.model_fields
    )


def _outside(metadata: list[Any]) -> list[float]:
    """Values just outside every bound a field declares."""
    values: list[float] = []
    for bound in metadata:
        if isinstance(bound, Ge):
            values.append(bound.ge - 1 if isinstance(bound.ge, int) else bound.ge - 0.01)
        elif isinstance(bound, Gt):
            values.append(bound.gt)
        elif isinstance(bound, Le):
            values.append(bound.le + 1 if isinstance(bound.le, int) else bound.le + 0.01)
        elif isinstance(bound, Lt):
            values.append(bound.lt)
    return values


BOUNDED = [
    (name, value)
    for name, info in SamplingSpec.model_fields.items()
    for value in _outside(info.metadata)
]


def test_ranges_are_declared_in_the_contract() -> None:
    names = {name for name, _ in BOUNDED}
    assert {"temperature", "top_p", "top_k", "n", "logprobs", "seed", "max_tokens"} <= names


@pytest.mark.parametrize(("name", "value"), BOUNDED, ids=lambda v: str(v))
def test_every_side_refuses_a_value_out_of_range(name: str, value: float) -> None:
    with pytest.raises(ValidationError):
        SamplingSpec(**{name: value})
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})
    if name != "logprobs":  # chat's logprobs is a flag (top_logprobs has the range)
        with pytest.raises(ValidationError):
            ChatCompletionRequest(**CHAT, **{name: value})
    with pytest.raises(ValidationError):
        CompletionRequest(**PROMPT, **{name: value})


@pytest.mark.parametrize(
    ("name", "value"),
    [("stop", [""]), ("stop", ["s"] * 17), ("logit_bias", {5: 101.0})],
)
def test_stop_and_logit_bias_rules_hold_on_every_side(name: str, value: Any) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**{name: value})
    http_value = {str(k): v for k, v in value.items()} if isinstance(value, dict) else value
    for model, base in ((CompletionRequest, PROMPT), (ChatCompletionRequest, CHAT)):
        with pytest.raises(ValidationError):
            model(**base, **{name: http_value})


def test_a_request_maps_onto_the_contract_field_by_field() -> None:
    """Every parameter a client sets arrives in the job unchanged (shape changes aside)."""
    values = {
        "n": 2,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.1,
        "presence_penalty": 0.3,
        "frequency_penalty": -0.3,
        "repetition_penalty": 1.2,
        "seed": 5,
        "min_tokens": 2,
        "stop_token_ids": [9],
        "ignore_eos": True,
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
    }
    shaped = {"stop": ["a"], "logit_bias": {3: 1.5}, "logprobs": 2, "max_tokens": 8}
    assert set(values) | set(shaped) == SPEC_FIELDS
    request = CompletionRequest(**PROMPT, **values, stop="a", logit_bias={"3": 1.5}, logprobs=2)
    spec = sampling_spec(request, 8)
    assert spec.model_dump() == {**values, **shaped}
    assert dataclasses.asdict(SamplingParams(**spec.model_dump())) == spec.model_dump()


def test_min_tokens_within_max_tokens_everywhere() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValidationError):
        CompletionRequest(**PROMPT, max_tokens=2, min_tokens=3)
    assert math.isclose(SamplingParams(top_k=-1).top_k, 0)  # -1 means off, as 0
