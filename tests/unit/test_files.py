"""Batch input files: every line checked, the first bad one named (1-based)."""

from __future__ import annotations

import json

import pytest

from api.batches.files import parse_batch_file
from api.errors import APIError

GOOD = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}


def content(*lines: object) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )


def test_good_lines_parse_in_order() -> None:
    chat = {**GOOD, "custom_id": "b", "url": "/v1/chat/completions", "body": {"messages": []}}
    lines = parse_batch_file(content(GOOD, chat), max_lines=10)
    assert [(line.index, line.custom_id, line.url) for line in lines] == [
        (0, "a", "/v1/completions"),
        (1, "b", "/v1/chat/completions"),
    ]
    assert parse_batch_file(content(GOOD).rstrip(b"\n"), max_lines=1)[0].body == {"prompt": "x"}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (b"{not json", "Line 2: not valid JSON"),
        ([1, 2], "Line 2: must be a JSON object"),
        ({**GOOD, "custom_id": ""}, "Line 2: custom_id must be a non-empty string"),
        ({**GOOD, "custom_id": "a"}, "Line 2: custom_id 'a' is used twice"),
        ({**GOOD, "custom_id": "b", "method": "GET"}, 'Line 2: method must be "POST"'),
        ({**GOOD, "custom_id": "b", "url": "/v1/embeddings"}, "Line 2: url must be one of"),
        ({**GOOD, "custom_id": "b", "body": "x"}, "Line 2: body must be a JSON object"),
        (b"", "Line 2: not valid JSON"),
    ],
)
def test_the_first_bad_line_is_named(bad: object, message: str) -> None:
    with pytest.raises(APIError) as info:
        parse_batch_file(content(GOOD, bad, GOOD), max_lines=10)
    assert info.value.status == 400 and info.value.message.startswith(message)
    assert info.value.code == "invalid_batch_line"


def test_empty_and_oversized_files() -> None:
    with pytest.raises(APIError, match="no lines"):
        parse_batch_file(b"", max_lines=10)
    with pytest.raises(APIError, match="at most 1"):
        parse_batch_file(content(GOOD, {**GOOD, "custom_id": "b"}), max_lines=1)
