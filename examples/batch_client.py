"""The Batch API with the official openai client: upload a JSONL file, create a batch, poll
it, download the output and error files.

    python examples/batch_client.py "Name three soups." "Write a haiku about bread."

Each prompt becomes one line (alternately chat and text completions: in Ladle a line's own
url decides its endpoint). Lines run in the batch lane: after interactive requests, in the
workers' spare room, exactly one output or error line each. From a shell:
`ladle batch submit FILE.jsonl`.
"""

from __future__ import annotations

import json
import os
import sys
import time

from openai import OpenAI

BASE_URL = os.environ.get("LADLE_BASE_URL", "http://127.0.0.1:8000")


def lines(model: str, prompts: list[str]) -> bytes:
    out = []
    for i, prompt in enumerate(prompts):
        if i % 2 == 0:
            url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
        else:
            url, body = "/v1/completions", {"prompt": prompt}
        body.update(model=model, max_tokens=48, temperature=0)
        out.append({"custom_id": f"request-{i}", "method": "POST", "url": url, "body": body})
    return "".join(json.dumps(line) + "\n" for line in out).encode()


def main() -> int:
    client = OpenAI(base_url=f"{BASE_URL}/v1", api_key=os.environ.get("LADLE_API_KEY", "none"))
    model = os.environ.get("LADLE_MODEL") or client.models.list().data[0].id
    prompts = sys.argv[1:] or ["Name three soups.", "The capital of France is"]
    uploaded = client.files.create(file=("prompts.jsonl", lines(model, prompts)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    print(f"batch {batch.id}: {batch.status}")
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(1)
        batch = client.batches.retrieve(batch.id)
        counts = batch.request_counts
        done = f"{counts.completed} done, {counts.failed} failed of {counts.total}"
        print(f"  {batch.status}: {done}")
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            for line in client.files.content(file_id).text.splitlines():
                result = json.loads(line)
                body = (result["response"] or {}).get("body", result["error"])
                print(result["custom_id"], json.dumps(body)[:200])
    return 0 if batch.status == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
