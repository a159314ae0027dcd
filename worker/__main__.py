"""`python -m worker`: OpenMP's defaults first (before torch loads), then the command line."""

from shared.config import apply_openmp_defaults

apply_openmp_defaults()

from worker.main import main  # noqa: E402  (after the OpenMP defaults, on purpose)

raise SystemExit(main())
