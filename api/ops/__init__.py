"""Operations: liveness, readiness, Prometheus metrics, the fleet and queue views, and the
web console's static files."""
