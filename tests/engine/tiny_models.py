"""`tests.support.tiny_models` under its old name, for test_native and test_quant."""

from tests.support.tiny_models import (
    ArgmaxSampler,
    ManualBatch,
    make_request,
    tiny_config,
    tiny_model_dir,
)

__all__ = ["ArgmaxSampler", "ManualBatch", "make_request", "tiny_config", "tiny_model_dir"]
