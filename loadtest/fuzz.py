"""Fuzz a running Ladle API from its own OpenAPI schema with schemathesis: no 5xx allowed.

    python -m loadtest.fuzz --base-url http://127.0.0.1:8000 --max-examples 200

Every operation gets `--max-examples` positive (schema-valid) and as many negative
(schema-violating) generated requests; a response of 500 or more is a failure, reported with
the request as a curl line. Needs `pip install schemathesis` (the `test` extra has it).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error


@dataclass
class FuzzReport:
    operations: int = 0
    calls: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _fuzz_operation(
    operation,
    mode: GenerationMode,
    max_examples: int,
    deadline: float,
    report: FuzzReport,
    headers: dict[str, str],
) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    def run(case) -> None:
        if time.monotonic() > deadline:
            return
        response = case.call(headers=headers, timeout=30)
        report.calls += 1
        report.statuses[response.status_code] = report.statuses.get(response.status_code, 0) + 1
        case.validate_response(response, checks=[not_a_server_error])

    try:
        run()
    except Unsatisfiable:
        pass  # nothing to make invalid (no parameters, no body)
    except Exception as exc:  # one failing operation must not hide the others
        report.failures.append(f"{operation.label} ({mode.value}): {exc}")


def fuzz(
    base_url: str, max_examples: int = 8, time_budget_s: float = 60.0, api_key: str | None = None
) -> FuzzReport:
    """Fuzz every operation of the API at `base_url`, positive then negative examples."""
    started = time.monotonic()
    deadline = started + time_budget_s
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    report = FuzzReport()
    for result in schema.get_all_operations():
        operation = result.ok()
        report.operations += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz_operation(operation, mode, max_examples, deadline, report, headers)
    report.seconds = time.monotonic() - started
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--max-examples", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=600.0, help="overall time budget")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args(argv)
    report = fuzz(args.base_url, args.max_examples, args.seconds, args.api_key)
    print(
        f"{report.operations} operations, {report.calls} calls in {report.seconds:.0f} s; "
        f"statuses {dict(sorted(report.statuses.items()))}"
    )
    for failure in report.failures:
        print("FAIL", failure)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
