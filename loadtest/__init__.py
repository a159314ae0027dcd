"""Load tests and benchmarks (`python -m loadtest.NAME`).

Importing the package sets the engine's OpenMP defaults before any benchmark imports torch,
as the worker's entry point does (`shared.config.apply_openmp_defaults`).
"""

from shared.config import apply_openmp_defaults

apply_openmp_defaults()
