"""Capped exponential backoff with jitter, for reconnecting to Redis."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    NoPermissionError,
    RedisError,
)

log = structlog.get_logger(__name__)
T = TypeVar("T")

REDIS_DOWN = (ConnectionError, TimeoutError, OSError)
# Waiting does not fix these: fail fast with the server's message.
REDIS_REFUSED = (AuthenticationError, AuthorizationError, NoPermissionError)


@dataclass(slots=True)
class Backoff:
    initial: float = 0.1
    cap: float = 5.0
    _next: float = 0.0

    def next_delay(self) -> float:
        self._next = min(self.cap, self._next * 2 if self._next else self.initial)
        return self._next * random.uniform(0.8, 1.2)

    def reset(self) -> None:
        self._next = 0.0


async def retry_until_done(operation: Callable[[], Awaitable[T]], what: str) -> T:
    """Run a Redis operation until it succeeds, backing off while Redis is unreachable."""
    backoff = Backoff()
    while True:
        try:
            return await operation()
        except REDIS_REFUSED:
            raise
        except (RedisError, *REDIS_DOWN) as exc:
            delay = backoff.next_delay()
            log.warning("redis_retry", operation=what, error=str(exc), retry_in=round(delay, 2))
            await asyncio.sleep(delay)
