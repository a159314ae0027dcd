"""Requests and tokens per minute per API key, metered in Redis so every API process shares them.

Each key has two hashes, `{p}:ratelimit:{bucket}:requests` and `:tokens`, whose fields are
Unix seconds and values what was admitted in that second: a sliding one-minute window at one
second resolution, on Redis's clock (`TIME`), admitted atomically by one Lua script. A request
reserves `prompt + n * max_tokens` tokens at admission; when its job ends, whoever writes the
final record gives back what was not used (`settle_lua`, inside that same atomic write), so a
job is settled exactly once. A reservation nobody settles (a job lost with Redis) just ages out.
"""

from __future__ import annotations

import math

WINDOW_S = 60

# KEYS: requests hash, tokens hash. ARGV: request limit, token limit, requests needed (0: only
# read), tokens needed, window. A limit of 0 is no limit. Returns {admitted, request limit,
# remaining, reset ms, token limit, remaining, reset ms, retry ms (-1: never fits), now s}.
ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1])
local now_ms = now * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[5])
local function scan(key)
  local entries = redis.call('HGETALL', key)
  local used, buckets = 0, {}
  for i = 1, #entries, 2 do
    local sec, n = tonumber(entries[i]), tonumber(entries[i + 1])
    if sec <= now - window then redis.call('HDEL', key, entries[i])
    else used = used + n; buckets[#buckets + 1] = {sec, n} end
  end
  table.sort(buckets, function(a, b) return a[1] < b[1] end)
  return used, buckets
end
local function wait_ms(buckets, used, limit, need)
  if limit <= 0 or used + need <= limit then return 0 end
  if need > limit then return -1 end
  local freed = 0
  for _, b in ipairs(buckets) do
    freed = freed + b[2]
    if used - freed + need <= limit then return (b[1] + window) * 1000 - now_ms end
  end
  return (now + window) * 1000 - now_ms
end
local function reset_ms(buckets)
  if #buckets == 0 then return 0 end
  return (buckets[#buckets][1] + window) * 1000 - now_ms
end
local req_limit, tok_limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local req_need, tok_need = tonumber(ARGV[3]), tonumber(ARGV[4])
local req_used, req_b = scan(KEYS[1])
local tok_used, tok_b = scan(KEYS[2])
local req_wait = wait_ms(req_b, req_used, req_limit, req_need)
local tok_wait = wait_ms(tok_b, tok_used, tok_limit, tok_need)
local admitted = 0
if req_need > 0 and req_wait == 0 and tok_wait == 0 then
  admitted = 1
  redis.call('HINCRBY', KEYS[1], now, req_need)
  redis.call('HINCRBY', KEYS[2], now, tok_need)
  redis.call('EXPIRE', KEYS[1], window + 1)
  redis.call('EXPIRE', KEYS[2], window + 1)
  req_used, tok_used = req_used + req_need, tok_used + tok_need
  req_b[#req_b + 1] = {now, req_need}
  tok_b[#tok_b + 1] = {now, tok_need}
end
local retry = math.max(req_wait, tok_wait)
if req_wait < 0 or tok_wait < 0 then retry = -1 end
return {admitted, req_limit, math.max(req_limit - req_used, 0), reset_ms(req_b),
        tok_limit, math.max(tok_limit - tok_used, 0), reset_ms(tok_b), retry, now}
"""


def settle_lua(key_index: int, arg_index: int) -> str:
    """Lua that gives back unused reserved tokens: KEYS[key_index] is the tokens hash ('' for
    none), ARGV[arg_index] the second the reservation was made, ARGV[arg_index + 1] how many
    to give back. A second that has left the window is not recreated."""
    key, second, refund = f"KEYS[{key_index}]", f"ARGV[{arg_index}]", f"ARGV[{arg_index + 1}]"
    return (
        f"if {key} ~= '' and tonumber({refund}) > 0 "
        f"and redis.call('HEXISTS', {key}, {second}) == 1 then\n"
        f"  redis.call('HINCRBY', {key}, {second}, -tonumber({refund}))\nend\n"
    )


def format_reset(ms: int) -> str:
    """OpenAI's reset format: `20ms`, `1s`, `1.5s`, `6m0s`."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest_ms = divmod(ms, 60_000)
    seconds = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


def retry_after_s(ms: int) -> int:
    """Whole seconds for `Retry-After`, never 0."""
    return max(1, math.ceil(ms / 1000))
