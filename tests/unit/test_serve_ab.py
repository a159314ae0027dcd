"""loadtest.serve_ab's command line: variants as NAME=ENV, errors for malformed ones."""

from __future__ import annotations

import pytest

from loadtest.serve_ab import parse_args


def test_variants_parse_into_names_and_environments() -> None:
    args = parse_args(
        [
            "--variant",
            "auto=",
            "--variant",
            "fixed=LLM_DECODE_THREADS=2;MODEL=/m",
            "--levels",
            "1,16",
        ]
    )
    assert args.variant == [("auto", {}), ("fixed", {"LLM_DECODE_THREADS": "2", "MODEL": "/m"})]
    assert args.levels == [1, 16]


@pytest.mark.parametrize(
    "variants",
    [
        ["--variant", "only="],  # nothing to compare with
        ["--variant", "a=", "--variant", "a=X=1"],  # the same name twice
        ["--variant", "a=", "--variant", "b=NOVALUE"],  # not KEY=VALUE
        ["--variant", "a=", "--variant", "=X=1"],  # no name
    ],
)
def test_malformed_variants_are_refused(variants: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(variants)
