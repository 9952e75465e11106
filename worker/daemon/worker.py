"""The worker daemon: wires the engine to Redis and runs until told to stop.

Tasks on one event loop: the consumer (reads only as many jobs as there are free slots), the
reclaimer (XAUTOCLAIM of jobs whose worker died), the lease keeper (re-claims our running jobs
so they never look idle), the heartbeat, the control listener and the publisher. The engine runs
on its own thread. Stopping: no new reads, in-flight jobs get ``drain_timeout`` to finish, the
rest are aborted without acknowledgement (another worker re-runs them), then everything closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import mlx.core as mx
import structlog
from redis.exceptions import OutOfMemoryError, ResponseError

from protocol.channels import ChannelHub
from protocol.codec_job import readable_request_id
from protocol.connection import RedisClient, connect, exists_each, redact
from protocol.constants import DEFAULT_ABORT_TTL_SECONDS
from protocol.keys import Keys
from protocol.limits import DEFAULT_LIMITS
from worker.daemon.backoff import (
    REDIS_FAILURES,
    REDIS_REFUSED,
    Outage,
    Retrier,
    describe,
    retry_until_done,
)
from worker.daemon.control import CommandRefused, ControlListener
from worker.daemon.eviction import check_eviction_policy
from worker.daemon.job_queue import Delivery, JobQueue
from worker.daemon.jobs import JobRunner
from worker.daemon.metrics import Metrics
from worker.daemon.permissions import check_permissions, redis_user
from worker.daemon.publisher import EventPublisher
from worker.daemon.sd_notify import Notifier
from worker.daemon.settings import WorkerSettings
from worker.engine import EngineConfig, EngineCore, SchedulerConfig
from worker.models import load_model

log = structlog.get_logger(__name__)
T = TypeVar("T")

BACKLOG_READ_LIMIT = 100_000
# How often the abort markers of running jobs are checked: the marker alone stops a job
# within this (the abort command is the faster path).
ABORT_POLL_SECONDS = 0.5


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        model_and_tokenizer: tuple[Any, Any] | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.keys = Keys(settings.prefix)
        self._model_and_tokenizer = model_and_tokenizer
        self._on_ready = on_ready
        self._stop = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._jobs: dict[str, asyncio.Task[None]] = {}  # entry id -> task
        self._backlog: list[Delivery] = []
        self.started_at = time.time()
        self.ready = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> int:
        settings = self.settings
        # Redis first: a wrong password, a missing permission or an evicting Redis fails now,
        # not after a model load that can take minutes (an unreachable Redis is waited for,
        # until a stop request).
        redis = await self._unless_stopped(retry_until_done(self._connect, "connect"))
        if redis is None:
            log.info("worker_stopped_before_serving", waiting_for="redis")
            return 0
        self.redis = redis
        self.hub = ChannelHub(self.redis)
        self.queue = JobQueue(
            self.redis,
            self.keys,
            settings.worker_id,
            int(settings.lease_seconds * 1000),
            settings.dead_letter_maxlen,
        )
        try:
            if not await self._unless_stopped(self._check_redis()):
                log.info("worker_stopped_before_serving", waiting_for="redis")
                return 0
            model, tokenizer = self._model_and_tokenizer or load_model(settings.model)
            if self._stop.is_set():
                log.info("worker_stopped_before_serving", waiting_for="model")
                return 0
            return await self._run_engine(model, tokenizer)
        finally:
            await self.hub.aclose()
            await self.redis.aclose()

    async def _unless_stopped(self, step: Awaitable[T]) -> T | None:
        """The step's result, or None when a stop request comes first (the step is
        cancelled): waiting for Redis must not make a service manager kill the worker."""
        task, stop = asyncio.ensure_future(step), asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait((task, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))
        return None if task.cancelled() else task.result()

    async def _check_redis(self) -> bool:
        """Everything the worker needs from Redis, before it loads the model: a policy that
        keeps its keys, every command it will send, and the consumer group."""
        settings = self.settings
        await retry_until_done(
            lambda: check_eviction_policy(
                self.redis, redact(settings.redis_url), allow=settings.allow_eviction
            ),
            "check maxmemory-policy",
        )
        await retry_until_done(
            lambda: check_permissions(
                self.redis,
                self.keys,
                settings.worker_id,
                redis_user(settings.redis_url),
                settings.dead_letter_maxlen,
            ),
            "check permissions",
        )
        await retry_until_done(self.queue.ensure_group, "create consumer group")
        return True

    async def _connect(self) -> RedisClient:
        settings = self.settings
        return await connect(
            settings.redis_url,
            topology=settings.redis_topology,
            socket_timeout=settings.socket_timeout,
            socket_connect_timeout=settings.socket_timeout,
            health_check_interval=30,
            # Every running job may have a command on the wire, plus the background tasks.
            max_connections=2 * settings.max_concurrency + 16,
        )

    async def _run_engine(self, model: Any, tokenizer: Any) -> int:
        settings = self.settings
        scheduler = SchedulerConfig(
            max_num_seqs=settings.max_concurrency, max_waiting_requests=settings.max_concurrency
        )
        self.engine = EngineCore(
            model, tokenizer, EngineConfig(model_name=settings.model, scheduler_config=scheduler)
        )
        self.publisher = EventPublisher(self.redis, self.keys, settings.log_ttl)
        self.runner = JobRunner(
            self.engine,
            self.redis,
            self.keys,
            self.queue,
            self.publisher,
            DEFAULT_LIMITS,
            settings.max_deliveries,
            settings.stream_interval,
            worker_id=settings.worker_id,
        )
        self.control = ControlListener(
            self.redis,
            self.hub,
            self.keys,
            settings.worker_id,
            self.engine,
            settings.cache_path,
            settings.reply_ttl,
            DEFAULT_LIMITS,
            self._abort,
            self._stats,
        )
        self.engine.set_step_listener(self.publisher.on_step)
        self.publisher.on_lost = self.runner.lose
        self.notifier = Notifier()
        self.metrics: Metrics | None = None
        if settings.metrics_port is not None:
            self.metrics = Metrics(
                settings.metrics_port, self.engine, self.runner, self.publisher, self.queue
            )
            self.publisher.on_done = self.metrics.observe_done
        try:
            await self.engine.start()
            if self.metrics is not None:
                self.metrics.start()
            self._backlog = await retry_until_done(
                lambda: self.queue.read_own_pending(BACKLOG_READ_LIMIT), "read own pending"
            )
            return await self._serve()
        finally:
            if self.metrics is not None:
                self.metrics.close()
            self.engine.close()

    async def _serve(self) -> int:
        settings = self.settings
        background = [
            asyncio.create_task(self.publisher.run(), name="publisher"),
            asyncio.create_task(self.control.listen(), name="control"),
            asyncio.create_task(
                self._every(settings.heartbeat_interval, self._heartbeat), name="heartbeat"
            ),
            asyncio.create_task(
                self._every(settings.lease_refresh_interval, self._extend_leases), name="leases"
            ),
            asyncio.create_task(
                self._every(ABORT_POLL_SECONDS, self._stop_aborted), name="abort_markers"
            ),
            asyncio.create_task(self.notifier.keep_alive(self.engine.is_running), name="watchdog"),
        ]
        if self.metrics is not None:
            background.append(
                asyncio.create_task(
                    self._every(settings.heartbeat_interval, self.metrics.refresh), name="metrics"
                )
            )
        readers = [
            asyncio.create_task(self._consume(), name="consumer"),
            asyncio.create_task(
                self._every(settings.reclaim_interval, self._reclaim), name="reclaimer"
            ),
        ]
        log.info(
            "worker_ready",
            worker_id=settings.worker_id,
            backlog=len(self._backlog),
            model=settings.model,
            max_concurrency=settings.max_concurrency,
        )
        self.notifier.ready(status=f"serving {settings.model} as {settings.worker_id}")
        self.ready.set()
        if self._on_ready is not None:
            self._on_ready()
        await self._stop.wait()
        log.info("worker_stopping", in_flight=len(self._jobs))
        self.notifier.stopping(status=f"draining {len(self._jobs)} jobs")
        await _cancel(readers)
        await self._drain()
        await _cancel(background)
        with contextlib.suppress(*REDIS_FAILURES):
            await self.redis.delete(self.keys.worker(settings.worker_id))
        try:
            # Jobs left pending (abandoned after the drain timeout) keep the consumer: they
            # wait for a restart under this id, or for another worker to reclaim them.
            left = await self.queue.leave_group()
        except REDIS_FAILURES as exc:
            log.warning("consumer_not_removed", error=describe(exc))
        else:
            log.info("consumer_removed" if left else "consumer_kept_with_pending_jobs")
        await self.engine.stop()
        log.info("worker_stopped")
        return 0

    async def _drain(self) -> None:
        jobs = list(self._jobs.values())
        if jobs:
            _, still_running = await asyncio.wait(jobs, timeout=self.settings.drain_timeout)
            if still_running:
                log.warning("drain_timeout_abandoning", jobs=len(still_running))
                await self.runner.abandon_all()
                await asyncio.wait(still_running, timeout=10)
        if not await self.publisher.drain(timeout=10):
            log.warning("publisher_not_drained", **self.publisher.stats())

    # -- reading jobs ------------------------------------------------------------------------

    async def _consume(self) -> None:
        retrier = Retrier("read jobs")
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
            try:
                deliveries = await self.queue.read_new(free, self.settings.read_block_ms)
            except REDIS_REFUSED:
                raise
            except REDIS_FAILURES as exc:
                await self._recreate_group_if_lost(exc)
                await retrier.failed(exc)
                continue
            retrier.succeeded()
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

    async def _abort(self, request_id: str) -> dict[str, Any]:
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

    async def _every(self, seconds: float, action: Callable[[], Awaitable[None]]) -> None:
        outage = Outage(action.__name__.strip("_"))
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

    async def _stats(self) -> dict[str, Any]:
        try:
            group = await self.queue.group_info()
        except REDIS_FAILURES as exc:
            group = {"error": describe(exc)}
        return {
            "worker_id": self.settings.worker_id,
            "jobs": self.runner.stats(),
            "publisher": self.publisher.stats(),
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
            active, cache, peak = await asyncio.to_thread(
                self.engine._engine_loop.call_sync, _mlx_memory, 1.0
            )
        except Exception as exc:  # engine stopped, or busy past the timeout: say so, don't fail
            memory["mlx_error"] = f"{type(exc).__name__}: {exc}"
        else:
            memory.update(
                mlx_active_memory_bytes=active,
                mlx_cache_memory_bytes=cache,
                mlx_peak_memory_bytes=peak,
            )
        return memory


def _mlx_memory(_scheduler: object) -> tuple[int, int, int]:
    return int(mx.get_active_memory()), int(mx.get_cache_memory()), int(mx.get_peak_memory())


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
