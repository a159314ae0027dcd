"""Wire records with every required field filled, for tests that need one but not its values."""

from __future__ import annotations

from shared.contracts import WorkerRecord


def worker_record(worker_id: str = "w", **fields: object) -> WorkerRecord:
    """A CPU float32 worker of model "m" (max_model_len 64, blocks of 16), `fields` on top."""
    values: dict = {
        "worker_id": worker_id,
        "host": "h",
        "pid": 1,
        "model": "m",
        "device": "cpu",
        "dtype": "float32",
        "max_model_len": 64,
        "block_size": 16,
    }
    return WorkerRecord(**{**values, **fields})
