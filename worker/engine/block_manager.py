"""`worker.engine.core.block_manager` under its old name, for the executor and the model runner."""

from worker.engine.core.block_manager import cdiv

__all__ = ["cdiv"]
