"""Ladle with the official `openai` client: a chat completion and a text completion.

python examples/client.py   (LADLE_BASE_URL, default http://127.0.0.1:8000; LADLE_API_KEY)
"""

from __future__ import annotations

import os

from openai import OpenAI

BASE_URL = os.environ.get("LADLE_BASE_URL", "http://127.0.0.1:8000")


def main() -> None:
    # Without LLM_API_KEYS on the server any key is accepted; the client insists on one.
    client = OpenAI(base_url=f"{BASE_URL}/v1", api_key=os.environ.get("LADLE_API_KEY", "none"))
    model = os.environ.get("LADLE_MODEL") or client.models.list().data[0].id

    chat = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You are a concise cook."},
            {"role": "user", "content": "Name three soups."},
        ],
        max_tokens=48,
        temperature=0,
    )
    print("chat:", chat.choices[0].message.content)
    print("  finish_reason:", chat.choices[0].finish_reason, "usage:", chat.usage)

    completion = client.completions.create(
        model=model, prompt="The best soup is", max_tokens=16, temperature=0.8, seed=7, n=2
    )
    for choice in completion.choices:
        print(f"completion[{choice.index}]:", repr(choice.text), choice.finish_reason)


if __name__ == "__main__":
    main()
