"""Async stand-ins (workers, responders) on their own loop in a thread.

The CLI runs its own ``asyncio.run`` in the test's thread, so whatever it talks to must run
elsewhere.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from types import TracebackType

BackgroundMain = Callable[[asyncio.Event], Awaitable[None]]


class Background:
    """Runs ``main(stop)`` on a private loop in a thread until the ``with`` block ends."""

    def __init__(self, main: BackgroundMain) -> None:
        self.main = main
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Background:
        self._thread.start()
        if not self._started.wait(5):
            raise AssertionError("background loop did not start")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        if self._thread.is_alive():
            raise AssertionError("background task did not stop")
        if self.error is not None and exc is None:
            raise self.error

    def _run(self) -> None:
        async def runner() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._started.set()
            await self.main(self._stop)

        try:
            asyncio.run(runner())
        except BaseException as exc:
            self.error = exc
