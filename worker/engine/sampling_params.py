"""`worker.engine.core.sampling_params` under the name users import it by."""

from worker.engine.core.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
