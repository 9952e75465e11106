"""Waiting out Redis trouble: capped exponential backoff with jitter, logged once per burst.

A Redis outage (or an out-of-memory spell) makes every retry fail the same way; one warning
when the burst starts, a reminder each minute while it lasts and one line when it ends say
as much as a warning per retry, without flooding the logs. Error texts never carry command
arguments: redis-py quotes a failing pipeline command, and those hold job bytes and prompts.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import structlog
from redis.exceptions import RedisClusterException, RedisError

from protocol.connection import REFUSED

log = structlog.get_logger(__name__)
T = TypeVar("T")

REDIS_DOWN = (ConnectionError, TimeoutError, OSError)
# Everything a Redis call can fail with that waiting may fix (a Cluster reshuffling its
# slots raises RedisClusterException, which is not a RedisError).
REDIS_FAILURES = (RedisError, RedisClusterException, *REDIS_DOWN)
# Waiting does not fix these: fail fast with the server's message.
REDIS_REFUSED = REFUSED

REMIND_EVERY: Final = 60.0
_MAX_ERROR_TEXT: Final = 300


def describe(exc: BaseException) -> str:
    """The error for a log line: its type and the server's words, without the command."""
    text = str(exc)
    _, quoted, after = text.rpartition(" of pipeline caused error: ")
    if quoted:
        text = after
    return f"{type(exc).__name__}: {text[:_MAX_ERROR_TEXT]}"


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


@dataclass(slots=True)
class Outage:
    """The failures of one operation in a row, logged as one burst."""

    operation: str
    failures: int = 0
    started: float = 0.0
    reminded: float = 0.0

    def failed(self, exc: BaseException, **context: Any) -> None:
        now = time.monotonic()
        self.failures += 1
        if self.failures == 1:
            self.started = self.reminded = now
            log.warning("redis_failing", operation=self.operation, error=describe(exc), **context)
        elif now - self.reminded >= REMIND_EVERY:
            self.reminded = now
            log.warning(
                "redis_still_failing",
                operation=self.operation,
                failures=self.failures,
                seconds=round(now - self.started, 1),
                error=describe(exc),
                **context,
            )

    def recovered(self) -> None:
        if self.failures:
            log.info(
                "redis_recovered",
                operation=self.operation,
                failures=self.failures,
                seconds=round(time.monotonic() - self.started, 1),
            )
            self.failures = 0


class Retrier:
    """Backoff and burst logging for one operation retried until it succeeds."""

    def __init__(self, operation: str) -> None:
        self.backoff = Backoff()
        self.outage = Outage(operation)

    async def failed(self, exc: BaseException, **context: Any) -> None:
        """Log (once per burst) and sleep before the next try."""
        self.outage.failed(exc, **context)
        await asyncio.sleep(self.backoff.next_delay())

    def succeeded(self) -> None:
        self.outage.recovered()
        self.backoff.reset()


async def retry_until_done(operation: Callable[[], Awaitable[T]], what: str) -> T:
    """Run a Redis operation until it succeeds, backing off while Redis fails. Only for
    operations that are safe to repeat: a failed try may have run on the server."""
    retrier = Retrier(what)
    while True:
        try:
            result = await operation()
        except REDIS_REFUSED:
            raise
        except REDIS_FAILURES as exc:
            await retrier.failed(exc)
            continue
        retrier.succeeded()
        return result
