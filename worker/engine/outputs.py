"""`worker.engine.core.outputs` under its old name, for the executor and the model runner."""

from worker.engine.core.outputs import (
    ModelRunnerOutput,
    SampledToken,
    ScheduledChunk,
    SchedulerOutput,
)

__all__ = ["ModelRunnerOutput", "SampledToken", "ScheduledChunk", "SchedulerOutput"]
