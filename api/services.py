"""The per-process objects every route uses, kept on `app.state.services`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from arq.connections import ArqRedis
from fastapi import Depends, Request

from api.batches.files import FileStore
from api.batches.store import BatchStore
from api.jobs.idempotency import IdempotencyStore
from api.jobs.relay import Relay
from api.jobs.store import JobStore
from api.jobs.workers import WorkerDirectory
from api.keys.keyring import KeyRingHolder
from api.keys.limits import RateLimiter
from api.openai.prompting import TokenizerHolder
from shared.config import Settings
from shared.keys import Keys
from shared.metrics import ApiMetrics


@dataclass
class Services:
    settings: Settings
    keys: Keys
    redis: ArqRedis
    relay: Relay
    jobs: JobStore
    workers: WorkerDirectory
    tokenizer: TokenizerHolder
    metrics: ApiMetrics
    files: FileStore
    batches: BatchStore
    keyring: KeyRingHolder
    limiter: RateLimiter
    idempotency: IdempotencyStore


def get_services(request: Request) -> Services:
    return request.app.state.services


# A route's `services: ServicesDep` parameter: the process's shared services.
ServicesDep = Annotated[Services, Depends(get_services)]
