"""The worker's pub/sub listener owns cancels (abort a job) and wake-ups (poll the queue now)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from shared.keys import Keys
from shared.retry import FOREVER, Backoff, retry
from worker.job_writer import REDIS_DOWN_ERRORS

logger = logging.getLogger(__name__)
SUBSCRIBE_BACKOFF = Backoff(first_s=0.1, max_s=2.0)


class Listener:
    """Subscribes to the cancel and wake channels; after a Redis outage, subscribes again."""

    def __init__(
        self, redis: Redis, keys: Keys, on_cancel: Callable[[str], None], wake: asyncio.Event
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.on_cancel = on_cancel
        self.wake = wake

    async def run(self) -> None:
        while True:
            pubsub = await retry(
                self._subscribe,
                on=(RedisError, OSError),
                what="subscribing to cancels and wake-ups",
                backoff=SUBSCRIBE_BACKOFF,
                give_up_after_s=FOREVER,
            )
            try:
                await self._listen(pubsub)
            except (RedisError, OSError) as exc:
                logger.warning("pub/sub listener lost Redis (%r); subscribing again", exc)
            finally:
                await _close_quietly(pubsub)

    async def _subscribe(self) -> PubSub:
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(self.keys.cancel_channel, self.keys.wake_channel)
        except BaseException:
            await _close_quietly(pubsub)
            raise
        return pubsub

    async def _listen(self, pubsub: PubSub) -> None:
        async for message in pubsub.listen():
            if message.get("type") != "message":
                continue
            channel, data = _text(message["channel"]), _text(message["data"])
            if channel == self.keys.wake_channel:
                self.wake.set()
            else:
                self.on_cancel(data)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def _close_quietly(pubsub: PubSub) -> None:
    try:
        await pubsub.aclose()
    except (*REDIS_DOWN_ERRORS, RedisError):
        pass
