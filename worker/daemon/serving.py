"""A serving worker's tasks, from ready to stopped.

On one event loop: the consumer (reads only as many jobs as there are free slots), the
reclaimer (XAUTOCLAIM of jobs whose worker died), the lease keeper (re-claims our running jobs
so they never look idle), the abort-marker poll, the heartbeat, the control listener, the
publisher and the metrics refresh. Stopping: no new reads, in-flight jobs get
``drain_timeout`` to finish, the rest are aborted without acknowledgement (another worker
re-runs them), then the consumer leaves the group if it holds nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from redis.exceptions import OutOfMemoryError, ResponseError

from protocol.codec_job import readable_request_id
from protocol.connection import RedisClient, exists_each
from protocol.constants import DEFAULT_ABORT_TTL_SECONDS
from protocol.keys import Keys
from worker.daemon.control import CommandRefused, ControlListener
from worker.daemon.job_queue import Delivery, JobQueue
from worker.daemon.jobs import JobRunner
from worker.daemon.metrics import Metrics, MetricSources
from worker.daemon.publisher import EventPublisher
from worker.daemon.redis_retry import (
    REDIS_FAILURES,
    REDIS_REFUSED,
    Outage,
    describe,
    retry_until_done,
)
from worker.daemon.sd_notify import Notifier
from worker.daemon.settings import WorkerSettings
from worker.engine import EngineCore

log = structlog.get_logger(__name__)

# How often the abort markers of running jobs are checked: the marker alone stops a job
# within this (the abort command is the faster path).
ABORT_POLL_SECONDS = 0.5


class Serving:
    """Everything a worker does between "ready" and "stopped", given its collaborators."""

    def __init__(
        self,
        *,
        settings: WorkerSettings,
        redis: RedisClient,
        keys: Keys,
        engine: EngineCore,
        queue: JobQueue,
        publisher: EventPublisher,
        runner: JobRunner,
        metrics: Metrics | None,
        backlog: list[Delivery],
        stop: asyncio.Event,
        started_at: float,
    ) -> None:
        """``backlog``: jobs already delivered to this consumer (a restart under the same id),
        run before new ones; ``stop``: set to stop serving."""
        self.settings = settings
        self.redis = redis
        self.keys = keys
        self.engine = engine
        self.queue = queue
        self.publisher = publisher
        self.runner = runner
        self.metrics = metrics
        self.notifier = Notifier()
        self._backlog = backlog
        self._stop = stop
        self.started_at = started_at
        self._slot_freed = asyncio.Event()
        self._jobs: dict[str, asyncio.Task[None]] = {}  # entry id -> task

    async def serve(self, control: ControlListener, on_ready: Callable[[], None]) -> int:
        """Serve until the stop event; ``on_ready`` is called once every task runs."""
        settings = self.settings
        background = [
            asyncio.create_task(self.publisher.run(), name="publisher"),
            asyncio.create_task(control.listen(), name="control"),
            self._periodic(settings.heartbeat_interval, self._heartbeat),
            self._periodic(settings.lease_refresh_interval, self._extend_leases),
            self._periodic(ABORT_POLL_SECONDS, self._stop_aborted),
            asyncio.create_task(self.notifier.keep_alive(self.engine.is_running), name="watchdog"),
        ]
        if self.metrics is not None:
            sources = MetricSources(
                engine=self.engine, runner=self.runner, publisher=self.publisher, queue=self.queue
            )
            metrics = self.metrics

            async def refresh_metrics() -> None:
                await metrics.refresh(sources)

            background.append(self._periodic(settings.heartbeat_interval, refresh_metrics))
        readers = [
            asyncio.create_task(self._consume(), name="consumer"),
            self._periodic(settings.reclaim_interval, self._reclaim),
        ]
        log.info(
            "worker_ready",
            worker_id=settings.worker_id,
            backlog=len(self._backlog),
            model=settings.model,
            max_concurrency=settings.max_concurrency,
        )
        self.notifier.ready(status=f"serving {settings.model} as {settings.worker_id}")
        on_ready()
        await self._stop.wait()
        log.info("worker_stopping", in_flight=len(self._jobs))
        self.notifier.stopping(status=f"draining {len(self._jobs)} jobs")
        await _cancel(readers)
        await self._drain()
        await _cancel(background)
        await self._leave()
        return 0

    async def _leave(self) -> None:
        """Say goodbye in Redis: no heartbeat, and no consumer unless it still holds jobs."""
        with contextlib.suppress(*REDIS_FAILURES):
            await self.redis.delete(self.keys.worker(self.settings.worker_id))
        try:
            # Jobs left pending (abandoned after the drain timeout) keep the consumer: they
            # wait for a restart under this id, or for another worker to reclaim them.
            left = await self.queue.leave_group()
        except REDIS_FAILURES as exc:
            log.warning("consumer_not_removed", error=describe(exc))
        else:
            log.info("consumer_removed" if left else "consumer_kept_with_pending_jobs")

    async def _drain(self) -> None:
        jobs = list(self._jobs.values())
        if jobs:
            _, still_running = await asyncio.wait(jobs, timeout=self.settings.drain_timeout)
            if still_running:
                log.warning("drain_timeout_abandoning", jobs=len(still_running))
                await self.runner.abandon_all()
                await asyncio.wait(still_running, timeout=10)
        if not await self.publisher.drain(timeout=10):
            log.warning("publisher_not_drained", **dataclasses.asdict(self.publisher.stats()))

    # -- reading jobs ------------------------------------------------------------------------

    async def _consume(self) -> None:
        while not self._stop.is_set():
            free = self.settings.max_concurrency - len(self._jobs)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            if self._backlog:
                batch, self._backlog = self._backlog[:free], self._backlog[free:]
                self._start(batch)
                continue
            deliveries = await retry_until_done(
                functools.partial(self.queue.read_new, free, self.settings.read_block_ms),
                "read jobs",
                on_failure=self._recreate_group_if_lost,
            )
            if self._stop.is_set():
                # Stopping, and the cancel of this task was lost (redis-py can swallow one
                # that lands as its read completes): start nothing more. What this read took
                # stays pending for us: a restart or another worker's reclaim runs it.
                return
            self._start(deliveries)

    async def _reclaim(self) -> None:
        """Take over jobs whose worker died (or gave the attempt up). Also while every slot is
        busy: what does not fit waits in the backlog, leases kept, and the consumer serves the
        backlog before reading new jobs. So orphaned jobs, older than anything new, run next
        instead of waiting until the stream runs dry."""
        room = self.settings.max_concurrency - len(self._backlog)
        if room > 0:
            claimed = await self.queue.reclaim(room)
            if claimed:
                log.info("jobs_reclaimed", count=len(claimed))
            self._start(claimed)

    async def _extend_leases(self) -> None:
        lost = await self.queue.extend_leases(
            list(self._jobs) + [d.entry_id for d in self._backlog]
        )
        if lost:
            log.warning("leases_lost", entries=lost)
            self._backlog = [d for d in self._backlog if d.entry_id not in lost]
            self.runner.lose_entries(lost)

    def _start(self, deliveries: list[Delivery], *, now: bool = False) -> None:
        """Run the deliveries, as many as there are free slots (``now``: all of them; for jobs
        that end before they reach the engine) and keep the rest in the backlog."""
        for delivery in deliveries:
            if delivery.entry_id in self._jobs:
                continue
            if len(self._jobs) >= self.settings.max_concurrency and not now:
                # The consumer's read and the reclaimer both sized their batch from the same
                # free slots: what does not fit waits in the backlog (ours, its lease kept)
                # instead of overfilling the engine, whose full queue would fail the job.
                if all(d.entry_id != delivery.entry_id for d in self._backlog):
                    self._backlog.append(delivery)
                continue
            task = asyncio.create_task(self.runner.run(delivery))
            self._jobs[delivery.entry_id] = task
            task.add_done_callback(functools.partial(self._job_done, delivery.entry_id))

    def _job_done(self, entry_id: str, task: asyncio.Task[None]) -> None:
        self._jobs.pop(entry_id, None)
        self._slot_freed.set()
        if not task.cancelled() and (failure := task.exception()) is not None:
            log.error("job_task_failed", entry_id=entry_id, error=describe(failure))

    # -- aborts ------------------------------------------------------------------------------

    async def abort(self, request_id: str) -> dict[str, Any]:
        """The abort command: stop the request wherever it is, as far as this worker can."""
        # The marker a producer sets (rule 5), so the command alone is enough.
        await self.redis.set(self.keys.abort(request_id), b"1", ex=DEFAULT_ABORT_TTL_SECONDS)
        if self.runner.running(request_id):
            return {"aborted": await self.runner.abort(request_id), "state": "running"}
        waiting = [d for d in self._backlog if readable_request_id(d.job_bytes) == request_id]
        if waiting:  # ours, waiting for a slot: it starts, sees its marker and ends at once
            self._backlog = [d for d in self._backlog if d not in waiting]
            self._start(waiting, now=True)
            return {"aborted": True, "state": "queued"}
        if not await self.redis.exists(self.keys.log(request_id)):
            raise CommandRefused("not_found", f"request {request_id!r} is unknown or expired")
        state = await self.runner.end_waiting(request_id)
        return {"aborted": state == "queued", "state": state}

    async def _stop_aborted(self) -> None:
        """Stop running jobs whose abort marker is set: the marker alone (without the control
        command, which may have gone to a worker that was not listening) stops a job within
        ``ABORT_POLL_SECONDS``. Also catches a command that arrived while the job was between
        its start checks and the engine. One round trip for all of them."""
        running = list(self.runner.in_flight)
        marked = await exists_each(self.redis, [self.keys.abort(rid) for rid in running])
        for request_id, is_marked in zip(running, marked, strict=True):
            if is_marked and await self.runner.abort(request_id):
                log.info("job_aborted_by_marker", request_id=request_id)

    # -- periodic ----------------------------------------------------------------------------

    def _periodic(
        self, seconds: float, action: Callable[[], Awaitable[None]]
    ) -> asyncio.Task[None]:
        """A task that runs ``action`` every ``seconds`` and waits out Redis failures."""
        name = getattr(action, "__name__", "periodic").strip("_")
        return asyncio.create_task(self._every(seconds, action, Outage(name)), name=name)

    async def _every(
        self, seconds: float, action: Callable[[], Awaitable[None]], outage: Outage
    ) -> None:
        while True:
            try:
                await action()
            except REDIS_REFUSED:
                raise
            except REDIS_FAILURES as exc:
                outage.failed(exc)
                await self._recreate_group_if_lost(exc)
            else:
                outage.recovered()
            await asyncio.sleep(seconds)

    async def _recreate_group_if_lost(self, exc: BaseException) -> None:
        """Redis lost its data (restart without persistence, failover to an empty replica):
        the group went with it. Re-create it so the worker serves again."""
        if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
            log.warning("consumer_group_missing_recreating")
            with contextlib.suppress(*REDIS_FAILURES):
                await self.queue.ensure_group()

    async def _heartbeat(self) -> None:
        beat = {
            "worker_id": self.settings.worker_id,
            "pid": os.getpid(),
            "started_at": self.started_at,
            "in_flight": len(self._jobs),
            "model": self.settings.model,
        }
        key, ttl_ms = (
            self.keys.worker(self.settings.worker_id),
            int(self.settings.heartbeat_ttl * 1000),
        )
        try:
            await self.redis.set(key, json.dumps(beat), px=ttl_ms)
        except OutOfMemoryError:
            # A full Redis (noeviction) refuses the write but not a new TTL: keep the last beat
            # alive, so a live worker does not look dead while memory is being freed.
            if not await self.redis.pexpire(key, ttl_ms):
                raise

    async def stats(self) -> dict[str, Any]:
        try:
            group = await self.queue.group_info()
        except REDIS_FAILURES as exc:
            group = {"error": describe(exc)}
        return {
            "worker_id": self.settings.worker_id,
            "jobs": dataclasses.asdict(self.runner.stats()),
            "publisher": dataclasses.asdict(self.publisher.stats()),
            "group": group,
            "memory": await self._memory(),
            "uptime_seconds": time.time() - self.started_at,
        }

    async def _memory(self) -> dict[str, Any]:
        """The process's resident memory and MLX's allocator figures. MLX is asked on the engine
        thread (the one thread that touches MLX), between two steps; a step longer than a second
        (a long prefill) leaves them out rather than hold up the reply."""
        memory: dict[str, Any] = {"rss_bytes": _rss_bytes()}
        try:
            mlx = await asyncio.to_thread(self.engine.memory_stats, 1.0)
        except Exception as exc:  # engine stopped, or busy past the timeout: say so, don't fail
            memory["mlx_error"] = f"{type(exc).__name__}: {exc}"
        else:
            memory.update(
                mlx_active_memory_bytes=mlx.active_bytes,
                mlx_cache_memory_bytes=mlx.cache_bytes,
                mlx_peak_memory_bytes=mlx.peak_bytes,
            )
        return memory


def _rss_bytes() -> int | None:
    """Resident set size from /proc (Linux); None where there is no /proc."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel and wait; cancel again while any survives (on Python 3.11 redis-py's internal
    ``wait_for`` can swallow a cancel that lands as its command completes)."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=1.0)
    for task in tasks:
        if not task.cancelled() and (failure := task.exception()) is not None:
            log.warning("task_failed", task=task.get_name(), error=describe(failure))
