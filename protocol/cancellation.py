"""A guard for long waits against cancellations that got lost on the way.

On Python 3.11, ``asyncio.wait_for`` returns normally if its inner future finishes in the same
loop step as a cancel arrives, dropping the cancellation (fixed in 3.12). redis-py sends every
command through ``wait_for`` when a socket timeout is set (its default since 6.x), so a
cancelled stream could keep waiting. The task still counts the request (``cancelling()``),
so loops call this once per round to honour it.
"""

from __future__ import annotations

import asyncio


def raise_if_cancelled() -> None:
    """Raise CancelledError if the current task was asked to cancel and is still running."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
