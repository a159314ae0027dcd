"""Submit a job, poll it until it is final, then read its events (httpx, no OpenAI client).

    python examples/jobs_client.py "Name three soups."

Jobs outlive the HTTP request: POST /v1/jobs answers 202 at once with the job id, GET
/v1/jobs/{id} shows its status (queued, in_progress, completed, failed, cancelled) and, when
completed, the OpenAI-shaped response; GET /v1/jobs/{id}/events replays what the worker
published (started, delta..., done or error) as server-sent events.
"""

from __future__ import annotations

import json
import os
import sys
import time

import httpx

BASE_URL = os.environ.get("LADLE_BASE_URL", "http://127.0.0.1:8000")
FINAL = {"completed", "failed", "cancelled"}


def main() -> int:
    headers = {}
    if os.environ.get("LADLE_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['LADLE_API_KEY']}"
    with httpx.Client(base_url=BASE_URL, headers=headers, timeout=30) as http:
        model = os.environ.get("LADLE_MODEL") or http.get("/v1/models").json()["data"][0]["id"]
        prompt = " ".join(sys.argv[1:]) or "Name three soups."
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 48,
            "temperature": 0,
        }
        created = http.post("/v1/jobs", json={"url": "/v1/chat/completions", "body": body})
        created.raise_for_status()
        job = created.json()
        print(f"submitted {job['id']}: {job['status']}")
        while job["status"] not in FINAL:
            time.sleep(0.5)
            polled = http.get(f"/v1/jobs/{job['id']}")
            polled.raise_for_status()
            job = polled.json()
            print(f"  {job['status']} (attempts: {job['attempts']}, worker: {job['worker_id']})")
        if job["status"] == "completed":
            print("answer:", job["response"]["choices"][0]["message"]["content"])
            print("usage:", job["usage"], "timings:", job["timings"])
        else:
            print("error:", job["error"])
        print("events:")
        with http.stream("GET", f"/v1/jobs/{job['id']}/events") as events:
            for line in events.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    print(" ", event["type"], {k: v for k, v in event.items() if k != "type"})
        return 0 if job["status"] == "completed" else 1


if __name__ == "__main__":
    raise SystemExit(main())
