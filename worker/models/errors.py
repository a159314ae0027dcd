"""The one error a model that cannot be served raises at load: a configuration error to
report in one line and not retry (unsupported architecture, remote code, missing weights)."""

from __future__ import annotations


class ModelConfigError(ValueError):
    """This model cannot be served as configured; the message says why in one line."""
