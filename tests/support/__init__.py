"""What tests and load tests share: tiny models, engines built for tests, and the harness that
starts a real service (API and workers as processes) on the test Redis. Nothing here is a
test or a fixture, so loadtest/ may import it; conftest files hold only fixtures."""
