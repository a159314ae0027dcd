"""A scripted stand-in for the worker: pops arq jobs, writes records and events per DESIGN.md.

Also a byte-level fake tokenizer (token id = UTF-8 byte + 3; BOS 1, EOS 2) for the API.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from arq.connections import ArqRedis
from arq.constants import job_key_prefix

from shared.contracts import (
    ChoiceEnd,
    ChoiceResult,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    JobPayload,
    JobRecord,
    JobResult,
    ModelInfo,
    StartedEvent,
    TokenLogprob,
    TopLogprob,
    Usage,
    WorkerRecord,
    encode_event,
)
from shared.keys import Keys
from shared.queue import deserialize_job

OFFSET, BOS, EOS = 3, 1, 2


class FakeTokenizer:
    eos_token_ids = [EOS]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + OFFSET for b in text.encode()]
        return [BOS, *ids] if add_special_tokens else ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - OFFSET for i in token_ids if i >= OFFSET).decode(errors="replace")

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: object
    ) -> list[int]:
        if any(m["role"] == "tool" for m in messages):
            raise ValueError("chat template failed: tool messages are not supported")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""), False)


TOKENIZER = FakeTokenizer()
Script = Callable[[JobPayload], list]


def reply_text(index: int) -> str:
    return f"Hi {index}!"


def default_script(payload: JobPayload, prompt_tokens: int = 5) -> list:
    """`started`, one delta per character of "Hi {index}!" per choice, then `done`."""
    events: list = [StartedEvent(worker_id="fake-1", prompt_tokens=prompt_tokens)]
    n = payload.num_choices
    texts = [reply_text(i) for i in range(n)]
    for pos in range(max(len(t) for t in texts)):
        for index, text in enumerate(texts):
            if pos < len(text):
                events.append(delta(index, text[pos], payload.sampling.logprobs))
    usage = Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=sum(len(t) for t in texts),
        total_tokens=prompt_tokens + sum(len(t) for t in texts),
    )
    ends = [ChoiceEnd(index=i, finish_reason="stop") for i in range(n)]
    return [*events, DoneEvent(choices=ends, usage=usage)]


def delta(index: int, char: str, num_logprobs: int | None = None) -> DeltaEvent:
    token_id = TOKENIZER.encode(char, False)[0]
    logprobs = None
    if num_logprobs is not None:
        top = [
            TopLogprob(token_id=token_id + k, token=chr(ord(char) + k), logprob=-0.5 - k)
            for k in range(num_logprobs)
        ]
        logprobs = [TokenLogprob(token_id=token_id, token=char, logprob=-0.5, top=top)]
    return DeltaEvent(index=index, text=char, token_ids=[token_id], logprobs=logprobs)


def error_script(status: int, message: str, code: str | None = None) -> Script:
    def script(payload: JobPayload) -> list:
        return [
            ErrorEvent(
                status=status,
                error_type="invalid_request_error",
                message=message,
                param="prompt",
                code=code,
            )
        ]

    return script


class FakeWorker:
    """Runs jobs from the queue with a script; `payloads` records what it received."""

    def __init__(
        self, redis: ArqRedis, keys: Keys, script: Script = default_script, step_s: float = 0.0
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.script = script
        self.step_s = step_s
        self.payloads: list[JobPayload] = []
        self.model = "test-model"
        self._task: asyncio.Task | None = None

    async def register(self, model: str = "test-model", max_model_len: int = 64) -> None:
        record = WorkerRecord(
            worker_id="fake-1",
            host="test",
            pid=1,
            model=model,
            device="cpu",
            dtype="float32",
            architecture="LlamaForCausalLM",
            weight_precision="float32",
            max_model_len=max_model_len,
            block_size=16,
            kv_blocks_used=3,
            kv_blocks_total=10,
        )
        self.model = model
        await self.redis.set(self.keys.worker("fake-1"), record.model_dump_json(), ex=30)
        await self.redis.hset(self.keys.models, model, ModelInfo.of(record).model_dump_json())
        await self.redis.zadd(self.keys.workers, {"fake-1": time.time()})

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            popped = await self.redis.zpopmin(self.keys.queue(self.model))
            popped = popped or await self.redis.zpopmin(self.keys.queue(self.model, "batch"))
            if not popped:
                await asyncio.sleep(0.005)
                continue
            job_id = popped[0][0].decode()
            job = deserialize_job(await self.redis.get(job_key_prefix + job_id))
            payload = JobPayload.model_validate_json(job["a"][0])
            self.payloads.append(payload)
            if not await self.redis.exists(self.keys.cancelled(job_id)):
                await self.run(payload)

    async def run(self, payload: JobPayload) -> None:
        record = JobRecord.model_validate_json(await self.redis.get(self.keys.job(payload.id)))
        record.status, record.attempts, record.worker_id = "in_progress", 1, "fake-1"
        record.started_at = time.time()
        await self.redis.set(self.keys.job(payload.id), record.model_dump_json())
        events = self.script(payload)
        for event in events:
            if self.step_s:
                await asyncio.sleep(self.step_s)
            if await self.redis.exists(self.keys.cancelled(payload.id)):
                events = [
                    ErrorEvent(
                        status=409,
                        error_type="cancelled",
                        message="cancelled",
                        code="job_cancelled",
                    )
                ]
                event = events[0]
            await self.redis.xadd(self.keys.stream(payload.id), {"data": encode_event(event)})
            if isinstance(event, (DoneEvent, ErrorEvent)):
                break
        await self._finish(record, events)

    async def _finish(self, record: JobRecord, events: list) -> None:
        last = events[-1]
        record.finished_at = time.time()
        if isinstance(last, DoneEvent):
            record.status = "completed"
            texts: dict[int, ChoiceResult] = {}
            for e in events:
                if isinstance(e, DeltaEvent):
                    c = texts.setdefault(
                        e.index,
                        ChoiceResult(index=e.index, text="", token_ids=[], finish_reason="stop"),
                    )
                    c.text += e.text
                    c.token_ids += e.token_ids
            record.result = JobResult(choices=list(texts.values()), usage=last.usage)
        else:
            record.status = "cancelled" if last.status == 409 else "failed"
            record.error = last
        await self.redis.set(self.keys.job(record.id), record.model_dump_json())
        if record.api_key_id:
            await self.redis.srem(self.keys.key_jobs(record.api_key_id), record.id)
