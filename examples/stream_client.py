"""Streaming chat with the official `openai` client: tokens print as the worker makes them.

python examples/stream_client.py "Write a haiku about soup."
"""

from __future__ import annotations

import os
import sys

from openai import OpenAI

BASE_URL = os.environ.get("LADLE_BASE_URL", "http://127.0.0.1:8000")


def main() -> None:
    client = OpenAI(base_url=f"{BASE_URL}/v1", api_key=os.environ.get("LADLE_API_KEY", "none"))
    model = os.environ.get("LADLE_MODEL") or client.models.list().data[0].id
    prompt = " ".join(sys.argv[1:]) or "Write a haiku about soup."
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=64,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        for choice in chunk.choices:
            print(choice.delta.content or "", end="", flush=True)
            if choice.finish_reason:
                print(f"\n[finish_reason: {choice.finish_reason}]")
        if chunk.usage:  # the last chunk, with include_usage
            print(
                f"[usage: {chunk.usage.prompt_tokens} prompt + "
                f"{chunk.usage.completion_tokens} completion tokens]"
            )


if __name__ == "__main__":
    main()
