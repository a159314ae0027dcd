"""The batch load generator's input: mixed endpoints, the invalid lines it says it made."""

from __future__ import annotations

import json

from api.batches.files import parse_batch_file
from loadtest.batch_load import batch_lines


def test_batch_lines_are_valid_jsonl_with_the_promised_invalid_ones() -> None:
    content, invalid = batch_lines(100, max_tokens=4, invalid_every=25)
    lines = parse_batch_file(content, max_lines=100)
    assert len(lines) == 100 and {line.url for line in lines} == {
        "/v1/completions",
        "/v1/chat/completions",
    }
    hot = {line.custom_id for line in lines if line.body["temperature"] > 2}
    assert hot == invalid == {"line-24", "line-49", "line-74", "line-99"}
    assert all(json.loads(raw)["body"]["max_tokens"] == 4 for raw in content.splitlines())
