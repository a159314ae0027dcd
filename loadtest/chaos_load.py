"""The chaos run's clients and its ledger: mixed requests (sync, streaming, the job API, batch
lines), each answer checked against the deterministic reference, every accepted job
followed to its final state."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

# What a client may see while faults are injected, all documented (docs/reliability.md):
# Redis away or full, no worker alive for a moment, a job lost with Redis, the API draining,
# a submission no replica confirmed (it may run: a retry with its Idempotency-Key replays it).
DOCUMENTED_503 = frozenset(
    {
        "redis_unavailable",
        "redis_out_of_memory",
        "no_workers",
        "job_lost",
        "server_shutting_down",
        "not_replicated",
    }
)
PROMPTS = ["w5 w17 w99 w42", "w7 w128 w64", "w11 w12 w13 w14 w15", "w300 w2 w9"]
KINDS = ("sync", "stream", "job")
FINAL = ("completed", "failed", "cancelled")


@dataclass
class Ledger:
    """What happened to every request of the run."""

    sent: int = 0
    completed: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # by reason
    lost: int = 0
    duplicated: int = 0
    wrong_text: int = 0
    undocumented_5xx: int = 0
    batch_lines: int = 0
    batch_lines_answered: int = 0
    kv_blocks_left: dict[str, int] = field(default_factory=dict)
    running_left: dict[str, int] = field(default_factory=dict)
    faults: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)  # what each duplicate or wrong output was
    failover_s: list[float] = field(default_factory=list)  # Sentinel: until a new primary
    # Accepted jobs whose final state no client has seen yet: followed up at the end.
    job_ids: set[str] = field(default_factory=set, repr=False)

    def fail(self, reason: str) -> None:
        self.failed[reason] = self.failed.get(reason, 0) + 1

    def status(self, status: int, code: str | None) -> None:
        """Count a refusal by reason; flag a 5xx that is not a documented 503."""
        self.fail(f"{status} {code}")
        if status >= 500 and not (status == 503 and code in DOCUMENTED_503):
            self.undocumented_5xx += 1

    def problems(self) -> list[str]:
        found = []
        for name in ("lost", "duplicated", "wrong_text", "undocumented_5xx"):
            if getattr(self, name):
                found.append(f"{name}: {getattr(self, name)}")
        if self.batch_lines != self.batch_lines_answered:
            found.append(f"batch lines {self.batch_lines}, answered {self.batch_lines_answered}")
        leaked = {w: n for w, n in self.kv_blocks_left.items() if n}
        running = {w: n for w, n in self.running_left.items() if n}
        if leaked or running:
            found.append(f"KV blocks left {leaked}, running {running}")
        return found

    def as_dict(self) -> dict:
        data = {k: v for k, v in self.__dict__.items() if k != "job_ids"}
        data["problems"] = self.problems()
        return data


def request_body(kind: str, prompt: str, model: str, max_tokens: int) -> tuple[str, dict]:
    """(url, body): completions for sync and jobs, chat for streams; greedy, fixed length."""
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if kind == "stream":
        messages = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", {**common, "messages": messages, "stream": True}
    return "/v1/completions", {**common, "prompt": prompt}


@dataclass
class Clients:
    """`num_clients` loops of mixed requests until `stop_at`, against `base_url`."""

    base_url: str
    model: str
    max_tokens: int
    ledger: Ledger
    reference: dict[tuple[str, str], str] = field(default_factory=dict)
    seed: int = 0

    async def run(self, num_clients: int, stop_at: float) -> None:
        await asyncio.gather(*(self._loop(i, stop_at) for i in range(num_clients)))

    async def _loop(self, index: int, stop_at: float) -> None:
        rng = random.Random(self.seed * 1000 + index)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=120) as http:
            while time.monotonic() < stop_at:
                kind, prompt = rng.choice(KINDS), rng.choice(PROMPTS)
                self.ledger.sent += 1
                try:
                    await self.one(http, kind, prompt)
                except httpx.HTTPError as exc:  # the API restarting: nothing was accepted, or
                    self.ledger.fail(f"transport {type(exc).__name__}")  # its job is in Redis
                    await asyncio.sleep(0.5)

    async def one(self, http: httpx.AsyncClient, kind: str, prompt: str) -> None:
        url, body = request_body(kind, prompt, self.model, self.max_tokens)
        if kind == "job":
            await self._job(http, url, body, prompt)
        elif kind == "stream":
            await self._stream(http, url, body, prompt)
        else:
            response = await http.post(url, json=body)
            self._note_job(response.headers.get("x-job-id"))
            if self._refused(response):
                return
            self._seen_final(response.headers.get("x-job-id"))
            self._check(kind, prompt, response.json()["choices"][0]["text"])

    async def _stream(self, http: httpx.AsyncClient, url: str, body: dict, prompt: str) -> None:
        text, error, done = "", None, False
        async with http.stream("POST", url, json=body) as response:
            self._note_job(response.headers.get("x-job-id"))
            if response.status_code != 200:
                await response.aread()
                self._refused(response)
                return
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    error = chunk.get("error", error)
                    for choice in chunk.get("choices", []):
                        text += choice.get("delta", {}).get("content") or ""
        if error is not None:
            self.ledger.status(error.get("status") or 503, error.get("code"))
        elif not done:
            self.ledger.fail("stream ended without [DONE]")
        else:
            self._seen_final(response.headers.get("x-job-id"))
            self._check("stream", prompt, text)

    async def _job(self, http: httpx.AsyncClient, url: str, body: dict, prompt: str) -> None:
        created = await http.post("/v1/jobs", json={"url": url, "body": body})
        if self._refused(created, accepted=202):
            return
        job_id = created.json()["id"]
        self._note_job(job_id)
        job = await poll_job(http, job_id, deadline=time.monotonic() + 300)
        if job is None or job["status"] == "missing":
            return  # followed up (and counted) in the final sweep
        self._seen_final(job_id)
        if job["status"] == "completed":
            self._check("job", prompt, job["response"]["choices"][0]["text"])
        else:
            error = job.get("error") or {}
            self.ledger.status(error.get("status") or 500, f"job {error.get('code')}")

    def _refused(self, response: httpx.Response, accepted: int = 200) -> bool:
        if response.status_code == accepted:
            return False
        try:
            code = response.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        self.ledger.status(response.status_code, code)
        return True

    def _note_job(self, job_id: str | None) -> None:
        if job_id:
            self.ledger.job_ids.add(job_id)

    def _seen_final(self, job_id: str | None) -> None:
        self.ledger.job_ids.discard(job_id or "")

    def _check(self, kind: str, prompt: str, text: str) -> None:
        """Every answer equals the first one for its prompt (greedy, fixed seed)."""
        key = ("chat" if kind == "stream" else "text", prompt)
        expected = self.reference.setdefault(key, text)
        if text == expected:
            self.ledger.completed += 1
        elif expected and text.startswith(expected) and len(text) > len(expected):
            self.ledger.duplicated += 1  # repeated tokens after a retry
            self.ledger.details.append(f"{kind} answer longer than the reference: {text!r}")
        else:
            self.ledger.wrong_text += 1
            self.ledger.details.append(f"{kind} answer {text!r} != reference {expected!r}")


async def poll_job(http: httpx.AsyncClient, job_id: str, deadline: float) -> dict | None:
    """The job once final, `{"status": "missing"}` if its record is gone, or None at the
    deadline; rides out API restarts and Redis blips."""
    while time.monotonic() < deadline:
        try:
            response = await http.get(f"/v1/jobs/{job_id}")
            if response.status_code == 404:
                return {"status": "missing"}  # accepted, and then gone: lost
            if response.status_code == 200 and response.json()["status"] in FINAL:
                return response.json()
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.25)
    return None
