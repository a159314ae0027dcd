#!/usr/bin/env bash
# Talk to a running Ladle with curl: models, a chat completion, a streamed one, a completion.
# Usage: examples/curl.sh   (LADLE_BASE_URL, default http://127.0.0.1:8000; LADLE_API_KEY if set)
set -euo pipefail

BASE="${LADLE_BASE_URL:-http://127.0.0.1:8000}"
AUTH=()
if [[ -n "${LADLE_API_KEY:-}" ]]; then AUTH=(-H "Authorization: Bearer ${LADLE_API_KEY}"); fi
MODEL="${LADLE_MODEL:-$(curl -sf "${AUTH[@]}" "$BASE/v1/models" \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')}"

echo "# GET /ready"
curl -s "$BASE/ready"; echo

echo "# POST /v1/chat/completions"
curl -s "$BASE/v1/chat/completions" "${AUTH[@]}" -H 'Content-Type: application/json' -d '{
  "model": "'"$MODEL"'",
  "messages": [{"role": "user", "content": "Name three soups."}],
  "max_tokens": 48, "temperature": 0
}'; echo

echo "# POST /v1/chat/completions, streamed (server-sent events)"
curl -sN "$BASE/v1/chat/completions" "${AUTH[@]}" -H 'Content-Type: application/json' -d '{
  "model": "'"$MODEL"'",
  "messages": [{"role": "user", "content": "Write a haiku about soup."}],
  "max_tokens": 32, "stream": true, "stream_options": {"include_usage": true}
}'; echo

echo "# POST /v1/completions"
curl -s "$BASE/v1/completions" "${AUTH[@]}" -H 'Content-Type: application/json' -d '{
  "model": "'"$MODEL"'", "prompt": "The best soup is", "max_tokens": 16, "seed": 7,
  "temperature": 0.8
}'; echo
