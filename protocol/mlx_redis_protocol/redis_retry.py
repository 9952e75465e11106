"""Waiting out Redis trouble: redis-py's Retry with capped exponential backoff and jitter,
failures logged once per burst.

A Redis outage (or an out-of-memory spell) makes every retry fail the same way; one warning
when the burst starts, a reminder each minute while it lasts and one line when it ends say
as much as a warning per retry, without flooding the logs. Error texts never carry command
arguments: redis-py quotes a failing pipeline command, and those hold job bytes and prompts.

It logs through the standard library's ``logging`` (logger ``mlx_redis_protocol.redis_retry``),
as a library should: each line's message is an event name and its fields ride in ``extra``,
which the worker's structlog set-up renders as key-value pairs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from redis.backoff import EqualJitterBackoff
from redis.exceptions import RedisClusterException, RedisError

from mlx_redis_protocol.connection import REFUSED, retry_forever

log = logging.getLogger(__name__)
T = TypeVar("T")

# Everything a Redis call can fail with that waiting may fix: redis-py's errors, a Cluster
# reshuffling its slots (RedisClusterException, which is not a RedisError), and the socket's
# own (OSError, which includes the builtin ConnectionError and TimeoutError).
REDIS_FAILURES = (RedisError, RedisClusterException, OSError)
# Waiting does not fix these: fail fast with the server's message.
REDIS_REFUSED = REFUSED

# Waits between tries: 0.1-0.2 s after the first failure, doubling up to 2.5-5 s.
_RETRY: Final = retry_forever(REDIS_FAILURES, EqualJitterBackoff(cap=5.0, base=0.1))

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
            log.warning(
                "redis_failing",
                extra={"operation": self.operation, "error": describe(exc), **context},
            )
        elif now - self.reminded >= REMIND_EVERY:
            self.reminded = now
            log.warning(
                "redis_still_failing",
                extra={
                    "operation": self.operation,
                    "failures": self.failures,
                    "seconds": round(now - self.started, 1),
                    "error": describe(exc),
                    **context,
                },
            )

    def recovered(self) -> None:
        if self.failures:
            log.info(
                "redis_recovered",
                extra={
                    "operation": self.operation,
                    "failures": self.failures,
                    "seconds": round(time.monotonic() - self.started, 1),
                },
            )
            self.failures = 0


async def retry_until_done(
    operation: Callable[[], Awaitable[T]],
    what: str,
    *,
    on_failure: Callable[[Exception], Awaitable[None]] | None = None,
    **context: Any,
) -> T:
    """Run a Redis operation until it succeeds, backing off while Redis fails; a refusal
    (REDIS_REFUSED) is raised at once. Only for operations that are safe to repeat: a failed
    try may have run on the server. ``on_failure`` runs after each failed try, before the
    wait; ``context`` goes into the burst's log lines."""
    outage = Outage(what)

    async def failed(exc: Exception) -> None:
        if on_failure is not None:
            await on_failure(exc)
        outage.failed(exc, **context)

    result = await _RETRY.call_with_retry(
        operation, failed, is_retryable=lambda exc: not isinstance(exc, REDIS_REFUSED)
    )
    outage.recovered()
    return result
