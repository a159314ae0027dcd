"""The per-process objects every route uses, kept on `app.state.services`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from arq.connections import ArqRedis
from fastapi import Depends, Request

from api.batches import BatchStore
from api.files import FileStore
from api.idempotency import IdempotencyStore
from api.jobs import JobStore
from api.keyring import KeyRingHolder
from api.prompting import TokenizerHolder
from api.ratelimit import RateLimiter
from api.relay import Relay
from api.workers import WorkerDirectory
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
