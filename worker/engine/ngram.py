"""`worker.engine.core.ngram` under its old name, for the executor and the model runner."""

from worker.engine.core.ngram import accept_drafts

__all__ = ["accept_drafts"]
