"""No task dies silently: a long-running task restarted with backoff, its failures logged.

A worker's and a gateway's background tasks (job readers, reclaimers, heartbeats, publishers,
lease keepers) loop forever. An error they do not expect (Redis refusing a command after an
ACL change, a bug) used to end the task with nothing logged until the process stopped, while
the rest of the process went on, advertising capacity nobody served. ``supervise`` runs such a
task: the first failure of a burst is one line at error level at once, the task starts again
after a backoff (0.5 s doubling to 10 s), a reminder follows each minute while it keeps
failing, and one line says when it has run ``healthy_after`` seconds without failing again.
While it is down its name is in ``down``, so the process can stop advertising what it serves.

It logs through the standard library's ``logging``, as the rest of the protocol library does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

from mlx_redis_protocol.redis_retry import REMIND_EVERY, describe

log = logging.getLogger(__name__)

FIRST_DELAY: Final = 0.5
MAX_DELAY: Final = 10.0
HEALTHY_AFTER: Final = 5.0


async def supervise(
    name: str,
    start: Callable[[], Awaitable[None]],
    *,
    down: set[str] | None = None,
    healthy_after: float = HEALTHY_AFTER,
    first_delay: float = FIRST_DELAY,
    max_delay: float = MAX_DELAY,
) -> None:
    """Run ``start()`` until it returns; restart it after any exception but a cancel.

    ``down`` gets ``name`` from a failure until the restarted task has run ``healthy_after``
    seconds without failing."""
    delay, failures, first_failure, reminded = first_delay, 0, 0.0, 0.0
    while True:
        task = asyncio.ensure_future(start())
        try:
            done, _ = await asyncio.wait({task}, timeout=healthy_after)
            if not done and failures:
                log.info(
                    "task_recovered",
                    extra={
                        "task": name,
                        "failures": failures,
                        "seconds": round(time.monotonic() - first_failure, 1),
                    },
                )
                delay, failures = first_delay, 0
                if down is not None:
                    down.discard(name)
            await task
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            now = time.monotonic()
            failures += 1
            if down is not None:
                down.add(name)
            if failures == 1:
                first_failure = reminded = now
                log.error(
                    "task_failed_restarting",
                    extra={"task": name, "error": describe(exc), "restart_in": delay},
                )
            elif now - reminded >= REMIND_EVERY:
                reminded = now
                log.error(
                    "task_still_failing",
                    extra={
                        "task": name,
                        "failures": failures,
                        "seconds": round(now - first_failure, 1),
                        "error": describe(exc),
                    },
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
