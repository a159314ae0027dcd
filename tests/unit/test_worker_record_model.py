"""What the worker record says of the served model: its architecture and weight precision."""

from __future__ import annotations

from types import SimpleNamespace

from worker.process import _architecture, _weight_precision


def test_weight_precision_is_the_quantization_else_the_dtype() -> None:
    assert _weight_precision("int4", "bfloat16") == "int4"
    assert _weight_precision("int8", "bfloat16") == "int8"
    assert _weight_precision("none", "float32") == "float32"


def test_architecture_is_the_checkpoints_class() -> None:
    config = SimpleNamespace(architectures=["Gemma3ForCausalLM"])
    engine = SimpleNamespace(executor=SimpleNamespace(loaded=SimpleNamespace(hf_config=config)))
    assert _architecture(engine) == "Gemma3ForCausalLM"  # type: ignore[arg-type]
    assert _architecture(SimpleNamespace(executor=object())) == ""  # type: ignore[arg-type]
