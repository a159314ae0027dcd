"""`python -m worker`: the allocator and OpenMP defaults first (before torch loads), then the
command line. `preload_allocator` may re-exec this process once with jemalloc/tcmalloc."""

from shared.config import apply_openmp_defaults, preload_allocator

preload_allocator()
apply_openmp_defaults()

from worker.main import main  # noqa: E402  (after the OpenMP defaults, on purpose)

raise SystemExit(main())
