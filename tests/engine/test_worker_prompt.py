"""The worker runs the prompt token ids the API sent: it never tokenizes a prompt again."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import fakeredis
import pytest

from shared.config import Settings
from shared.contracts import JobPayload, JobRecord, SamplingSpec, decode_event
from shared.keys import Keys
from tests.support.engines import assert_all_blocks_free, make_engine
from worker.service import HandBack, WorkerService

TOKENIZING = ("encode", "apply_chat_template", "chat_text")


class NoTokenizing:
    """Wraps a tokenizer; decoding works, any way of tokenizing text fails the test."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name in TOKENIZING:
            self.calls.append(name)
            raise AssertionError(f"the worker called tokenizer.{name}")
        return getattr(self._inner, name)


PROMPT_IDS = [7, 8, 9, 10, 11]


def greedy_job(job_id: str, max_tokens: int, **fields: Any) -> JobPayload:
    """A greedy job on PROMPT_IDS (a chat job where `messages` are given)."""
    return JobPayload(
        id=job_id,
        endpoint="chat.completions" if "messages" in fields else "completions",
        model="tiny",
        prompt_token_ids=PROMPT_IDS,
        sampling=SamplingSpec(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        **fields,
    )


async def _run(service: WorkerService, redis: Any, payload: JobPayload) -> list:
    keys = service.keys
    record = JobRecord(id=payload.id, url="/v1/chat/completions", model=payload.model)
    await redis.set(keys.job(payload.id), record.model_dump_json())
    service.start()
    try:
        status = await asyncio.wait_for(service.run_job(payload, 1), 60)
    finally:
        await service.stop()
    assert status == "completed"
    entries = await redis.xrange(keys.stream(payload.id))
    return [decode_event(fields[b"data"]) for _, fields in entries]


def test_the_worker_does_not_tokenize_a_prompt_the_api_tokenized(
    tiny_model_dirs: dict[str, Path],
) -> None:
    engine = make_engine(tiny_model_dirs["llama"])
    engine.tokenizer = NoTokenizing(engine.tokenizer)  # type: ignore[assignment]
    tokenizer = NoTokenizing(engine.tokenizer._inner)
    # The text would tokenize to other ids: the worker must run the ids it was sent.
    prompt_ids = PROMPT_IDS
    payload = greedy_job("job-1", 4, messages=[{"role": "user", "content": "w50 w51"}])

    async def scenario() -> list:
        redis = fakeredis.FakeAsyncRedis()
        settings = Settings(key_prefix="t")
        service = WorkerService(settings, engine, tokenizer, redis, "w-1")  # type: ignore[arg-type]
        assert service.keys == Keys("t")
        return await _run(service, redis, payload)

    events = asyncio.run(scenario())
    started, done = events[0], events[-1]
    assert started.type == "started" and started.prompt_tokens == len(prompt_ids)
    assert done.type == "done" and done.usage.prompt_tokens == len(prompt_ids)
    assert done.usage.completion_tokens == 4
    assert tokenizer.calls == [] and engine.tokenizer.calls == []
    expected = engine_greedy(tiny_model_dirs["llama"], prompt_ids)
    assert [t for e in events if e.type == "delta" for t in e.token_ids] == expected
    assert_all_blocks_free(engine)


def engine_greedy(model_dir: Path, prompt_ids: list[int], max_tokens: int = 4) -> list[int]:
    """The same ids straight through an engine: what the job must have generated."""
    from worker.engine.core.sampling_params import SamplingParams
    from worker.engine.offline import LLM

    llm = LLM(engine=make_engine(model_dir))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([prompt_ids], params)[0].outputs[0].token_ids


def test_a_retry_on_the_same_worker_never_gets_the_aborted_attempts_tokens(
    tiny_model_dirs: dict[str, Path],
) -> None:
    """Attempt 1 is handed back mid-generation and attempt 2 starts on this worker at once,
    while attempt 1's last outputs may still be on their way to the event loop: attempt 2's
    events must be exactly a fresh run (one id per attempt in the engine)."""
    engine = make_engine(tiny_model_dirs["llama"])
    tokenizer = engine.tokenizer
    prompt_ids = PROMPT_IDS
    payload = greedy_job("job-r", 24)

    async def scenario() -> tuple[str, list]:
        redis = fakeredis.FakeAsyncRedis()
        service = WorkerService(Settings(key_prefix="t"), engine, tokenizer, redis, "w-1")  # type: ignore[arg-type]
        keys = service.keys
        record = JobRecord(id=payload.id, url="/v1/completions", model=payload.model)
        await redis.set(keys.job(payload.id), record.model_dump_json())
        service.start()
        try:
            first = asyncio.create_task(service.run_job(payload, 1))
            deadline = asyncio.get_running_loop().time() + 60
            while asyncio.get_running_loop().time() < deadline:
                job = service.jobs.get(payload.id)
                if job is not None and len(job.choices[0].token_ids) >= 2:
                    break
                await asyncio.sleep(0)
            assert service.hand_back_all() == [payload.id]
            with pytest.raises(HandBack):
                await first
            status = await asyncio.wait_for(service.run_job(payload, 2), 60)  # no waiting
        finally:
            await service.stop()
        entries = await redis.xrange(keys.stream(payload.id))
        return status, [decode_event(fields[b"data"]) for _, fields in entries]

    status, events = asyncio.run(scenario())
    assert status == "completed"
    restart = next(i for i, e in enumerate(events) if e.type == "restart")
    second = [e for e in events[restart:] if e.type == "delta"]
    assert [e.pos for e in second] == list(range(len(second)))  # contiguous from 0
    expected = engine_greedy(tiny_model_dirs["llama"], prompt_ids, max_tokens=24)
    assert [t for e in second for t in e.token_ids] == expected
    assert events[-1].type == "done" and events[-1].usage.completion_tokens == 24
    assert_all_blocks_free(engine)
