"""The worker's media decoding pool: a few threads, taken in turn by tenants.

Decoding and resizing run here, off the event loop and off the engine thread. The pool has
``threads`` threads (the CPU a worker gives to media); work beyond them waits in one queue
per tenant, and a freed thread goes to the tenants in turn (round robin), so one tenant's
flood of 50 MB images delays another tenant's image by one decode at most, not by the whole
flood. The queue is bounded by the worker's slots: each waiting piece is a job's.
Pillow and FFmpeg release the GIL while they decode, so the engine thread keeps stepping;
the threads run at the lowest CPU priority, so on a machine short of cores the engine
thread's steps (every tenant's tokens) and the event loop come before one tenant's images.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from mlx_redis_worker.thread_priority import lower_this_thread

T = TypeVar("T")


@dataclass
class MediaPoolStats:
    """Decoding work done and waiting, for stats and metrics."""

    threads: int
    running: int = 0
    waiting: int = 0
    done: int = 0  # pieces decoded (or refused while decoding)
    busy_seconds: float = 0.0  # thread time spent decoding


class MediaPool:
    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError("the media pool needs at least one thread")
        self._executor = ThreadPoolExecutor(
            threads, thread_name_prefix="media", initializer=lower_this_thread
        )
        self._threads = threads
        self._running = 0
        self._queues: dict[str, deque[asyncio.Future[None]]] = {}
        self._turns: deque[str] = deque()  # tenants with work waiting, in turn order
        self.stats = MediaPoolStats(threads=threads)

    async def run(self, tenant: str, work: Callable[[], T]) -> T:
        """``work()`` on a pool thread, when ``tenant``'s turn comes."""
        await self._take_turn(tenant)
        started = time.perf_counter()
        running = asyncio.get_running_loop().run_in_executor(self._executor, work)

        def finished(_: object) -> None:
            spent = time.perf_counter() - started
            self.stats.busy_seconds += spent
            self.stats.done += 1
            self._release()

        # The thread is released when the work ends, even for a caller cancelled meanwhile
        # (an aborted job): a thread cannot be stopped, so it is not given to another yet.
        running.add_done_callback(finished)
        return await asyncio.shield(running)

    async def _take_turn(self, tenant: str) -> None:
        if self._running < self._threads and not self._turns:
            self._running += 1
            self.stats.running = self._running
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._queues.setdefault(tenant, deque())
        if not queue:
            self._turns.append(tenant)
        queue.append(turn)
        self.stats.waiting += 1
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release()  # granted as it was cancelled: pass the thread on
            else:
                self._forget(tenant, turn)
            raise

    def _release(self) -> None:
        """A thread is free: to the next tenant in turn, else idle."""
        while self._turns:
            tenant = self._turns.popleft()
            queue = self._queues[tenant]
            turn = queue.popleft()
            if queue:
                self._turns.append(tenant)
            else:
                del self._queues[tenant]
            self.stats.waiting -= 1
            if not turn.done():
                turn.set_result(None)  # the thread passes to it: running stays the same
                return
        self._running -= 1
        self.stats.running = self._running

    def _forget(self, tenant: str, turn: asyncio.Future[None]) -> None:
        queue = self._queues.get(tenant)
        if queue is None or turn not in queue:
            return
        queue.remove(turn)
        self.stats.waiting -= 1
        if not queue:
            del self._queues[tenant]
            self._turns.remove(tenant)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
