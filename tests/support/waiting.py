"""Running a coroutine from a synchronous test, and polling a condition until it holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def run(coroutine: Awaitable[T]) -> T:
    """``asyncio.run`` for any awaitable (a coroutine, a task factory's result, a future)."""

    async def main() -> T:
        return await coroutine

    return asyncio.run(main())


# What a wait is for, in its timeout message; a function is asked only then (say, for the tail
# of a log as it is at that moment).
What = str | Callable[[], str]


def wait_until(
    condition: Callable[[], Any], timeout: float, what: What, interval: float = 0.05
) -> Any:
    """Poll a synchronous condition until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(timeout, what)
        time.sleep(interval)


async def until(
    condition: Callable[[], Awaitable[Any]], timeout: float, what: What, interval: float = 0.05
) -> Any:
    """Poll an async condition until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = await condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(timeout, what)
        await asyncio.sleep(interval)


def _timed_out(timeout: float, what: What) -> AssertionError:
    described = what() if callable(what) else what
    return AssertionError(f"timed out after {timeout:g} s waiting for {described}")
