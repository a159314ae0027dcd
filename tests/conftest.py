"""The whole suite: OpenMP's defaults before any test imports torch, as the worker does."""

from shared.config import apply_openmp_defaults

apply_openmp_defaults()
