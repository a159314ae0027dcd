"""`worker.engine.core.request` under its old name, for the executor and the model runner."""

from worker.engine.core.request import Request

__all__ = ["Request"]
