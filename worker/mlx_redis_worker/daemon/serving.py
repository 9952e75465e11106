"""A serving worker's tasks, from ready to stopped.

On one event loop: per model lane (worker/mlx_redis_worker/daemon/lane.py) the consumer (reads only
as many jobs as there are free slots), the reclaimer (XAUTOCLAIM of jobs whose worker died) and the
lease keeper (re-claims our running jobs so they never look idle); the default stream's forwarder;
the abort-marker poll, the heartbeat and the activity key, the control listener, the
publisher and the metrics refresh. Stopping: no new reads, in-flight jobs get
``drain_timeout`` to finish, the rest are aborted without acknowledgement (another worker
re-runs them), then the consumer leaves the group if it holds nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from importlib.metadata import version
from typing import Any

import structlog
from redis.exceptions import OutOfMemoryError

from mlx_redis_protocol.activity import Activity
from mlx_redis_protocol.connection import RedisClient, get_each
from mlx_redis_protocol.constants import DEFAULT_ABORT_TTL_SECONDS
from mlx_redis_protocol.control import abort_marker, marker_stops
from mlx_redis_protocol.heap import freeze_start_up_heap
from mlx_redis_protocol.heartbeat import Heartbeat
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.redis_retry import (
    REDIS_FAILURES,
    REDIS_REFUSED,
    Outage,
    describe,
)
from mlx_redis_protocol.registry import register_worker, unregister_worker
from mlx_redis_protocol.sd_notify import Notifier
from mlx_redis_protocol.supervisor import supervise
from mlx_redis_worker.daemon.claim import EXIT_ID_HELD, WorkerClaim, WorkerIdHeld
from mlx_redis_worker.daemon.control import CommandRefused, ControlListener
from mlx_redis_worker.daemon.forwarder import DefaultStreamForwarder
from mlx_redis_worker.daemon.job_queue import JobQueue
from mlx_redis_worker.daemon.lane import ModelLane
from mlx_redis_worker.daemon.metrics import Metrics, MetricSources
from mlx_redis_worker.daemon.publisher import EventPublisher
from mlx_redis_worker.daemon.registration import RegistrySchedule
from mlx_redis_worker.daemon.settings import WorkerSettings
from mlx_redis_worker.engine.stats import plain

log = structlog.get_logger(__name__)

# How often the abort markers of running jobs are checked: the marker alone stops a job
# within this (the abort command is the faster path).
ABORT_POLL_SECONDS = 0.5
# How long "ready" waits for the worker to be reachable (registered, control subscribed):
# beyond it (Redis failing meanwhile) the worker says ready anyway and says which is missing.
READY_REACHABLE_SECONDS = 30.0
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
WORKER_VERSION = version("mlx-redis-worker")


class Serving:
    """Everything a worker does between "ready" and "stopped", given its collaborators."""

    def __init__(
        self,
        *,
        settings: WorkerSettings,
        redis: RedisClient,
        keys: Keys,
        lanes: list[ModelLane],
        forwarder: DefaultStreamForwarder,
        publisher: EventPublisher,
        metrics: Metrics | None,
        stop: asyncio.Event,
        started_at: float,
        claim: WorkerClaim,
    ) -> None:
        """``lanes``: one per model, the default model's first when it is served here;
        ``stop``: set to stop serving; ``claim``: this worker's on its id, renewed with the
        heartbeat."""
        self.settings = settings
        self.redis = redis
        self.keys = keys
        self.lanes = lanes
        self.forwarder = forwarder
        self.publisher = publisher
        self.metrics = metrics
        self.notifier = Notifier()
        self._stop = stop
        self.started_at = started_at
        self.claim = claim
        # Set when another worker took this one's id (its claim expired during an outage):
        # the heartbeat, registry member and consumers under the id are that worker's now.
        self.id_lost_to: str | None = None
        # What the activity key last said (its buckets and requests) and when (monotonic).
        self._activity_written: tuple[object, ...] | None = None
        self._activity_written_at = -float("inf")
        # Supervised tasks down now (failed, waiting to restart): see ``supervise``.
        self.down: set[str] = set()
        self.registry = RegistrySchedule(settings.heartbeat_interval)
        # Set at the first registration: from then on broadcasts (ctl stats, ping) count us.
        self.registered = asyncio.Event()

    @property
    def in_flight(self) -> int:
        return sum(len(lane.jobs) for lane in self.lanes)

    @property
    def queues(self) -> list[JobQueue]:
        """Every job stream this worker reads: the default one, then each model's."""
        return [self.forwarder.queue, *(lane.queue for lane in self.lanes)]

    def lanes_for(self, model: str | None) -> list[ModelLane]:
        """The lanes a command for ``model`` concerns (all of them for None)."""
        return [lane for lane in self.lanes if model is None or lane.name == model]

    async def serve(self, control: ControlListener, on_ready: Callable[[], None]) -> int:
        """Serve until the stop event; ``on_ready`` is called once every task runs."""
        settings = self.settings
        background = [
            self._supervised("publisher", self.publisher.run),
            self._supervised("control", control.listen),
            self._periodic(settings.heartbeat_interval, self._heartbeat),
            self._periodic(settings.activity_interval, self._activity),
            self._periodic(ABORT_POLL_SECONDS, self._stop_aborted),
        ]
        background += [
            self._periodic(
                settings.lease_refresh_interval, lane.extend_leases, f"leases {lane.name}"
            )
            for lane in self.lanes
        ]
        if self.metrics is not None:
            sources = [
                MetricSources(
                    model=lane.name,
                    engine=lane.engine,
                    runner=lane.runner,
                    queue=lane.queue,
                    fair=lane.fair,
                )
                for lane in self.lanes
            ]
            metrics, publisher = self.metrics, self.publisher

            async def refresh_metrics() -> None:
                await metrics.refresh(sources, publisher)

            background.append(self._periodic(settings.heartbeat_interval, refresh_metrics))
        readers = [self._supervised("forwarder", self.forwarder.consume)]
        readers.append(
            self._periodic(settings.reclaim_interval, self.forwarder.reclaim, "forwarder reclaim")
        )
        for lane in self.lanes:
            readers.append(self._supervised(_consumer(lane), lane.consume))
            readers.append(
                self._periodic(settings.reclaim_interval, lane.reclaim, f"reclaim {lane.name}")
            )
        models = [lane.name for lane in self.lanes]
        unreachable = await self._until_reachable(control)
        frozen = freeze_start_up_heap()
        log.info(
            "worker_ready",
            unreachable=unreachable or None,
            frozen_objects=frozen,
            worker_id=settings.worker_id,
            backlog=sum(len(lane.backlog) for lane in self.lanes),
            models=models,
            default_model=self.forwarder.default_model,
            max_concurrency=settings.max_concurrency,
        )
        self.notifier.ready(status=f"serving {', '.join(models)} as {settings.worker_id}")
        # systemd arms the watchdog once start-up completes (READY=1): its pings follow it.
        background.append(
            self._supervised(
                "watchdog", functools.partial(self.notifier.keep_alive, self._engines_running)
            )
        )
        on_ready()
        await self._stop.wait()
        log.info("worker_stopping", in_flight=self.in_flight)
        self.notifier.stopping(status=f"draining {self.in_flight} jobs")
        await _cancel(readers)
        await self._drain()
        await _cancel(background)
        if self.id_lost_to is not None:
            return EXIT_ID_HELD
        await self._leave()
        return 0

    async def _until_reachable(self, control: ControlListener) -> list[str]:
        """Wait until broadcasts count this worker (it is in the registry) and reach it (the
        control channel is subscribed), so that a `ctl stats` sent after "ready" includes it;
        bounded by ``READY_REACHABLE_SECONDS`` and by a stop. What is still missing then."""
        waits = {"registry": self.registered, "control channel": control.listening}

        async def until_reachable() -> None:
            for event in waits.values():
                await event.wait()

        async def until_stopped() -> None:
            await self._stop.wait()

        tasks = [asyncio.create_task(until_reachable()), asyncio.create_task(until_stopped())]
        await asyncio.wait(
            tasks, timeout=READY_REACHABLE_SECONDS, return_when=asyncio.FIRST_COMPLETED
        )
        await _cancel(tasks)
        return [name for name, event in waits.items() if not event.is_set()]

    def _engines_running(self) -> bool:
        return all(lane.engine.is_running() for lane in self.lanes)

    async def _leave(self) -> None:
        """Say goodbye in Redis: no heartbeat, and no consumer unless it still holds jobs."""
        with contextlib.suppress(*REDIS_FAILURES):
            worker_id = self.settings.worker_id
            await self.redis.delete(self.keys.worker(worker_id), self.keys.activity(worker_id))
            await unregister_worker(self.redis, self.keys, worker_id)
        for queue in self.queues:
            try:
                # Jobs left pending (abandoned after the drain timeout) keep the consumer: they
                # wait for a restart under this id, or for another worker to reclaim them.
                left = await queue.leave_group()
            except REDIS_FAILURES as exc:
                log.warning("consumer_not_removed", stream=queue.stream.stream, error=describe(exc))
            else:
                log.info(
                    "consumer_removed" if left else "consumer_kept_with_pending_jobs",
                    stream=queue.stream.stream,
                )

    async def _drain(self) -> None:
        await asyncio.gather(*(lane.drain(self.settings.drain_timeout) for lane in self.lanes))
        if not await self.publisher.drain(timeout=10):
            log.warning("publisher_not_drained", **dataclasses.asdict(self.publisher.stats()))

    # -- aborts ------------------------------------------------------------------------------

    async def abort(self, request_id: str, model: str | None = None) -> dict[str, Any]:
        """The abort command: stop the request wherever it is, as far as this worker can; with
        ``model``, only where that model's jobs are (the caller serves it)."""
        # The marker a producer sets (rule 5), so the command alone is enough.
        await self.redis.set(
            self.keys.abort(request_id), abort_marker(model), ex=DEFAULT_ABORT_TTL_SECONDS
        )
        lanes = [lane for lane in self.lanes if model in (None, lane.name)]
        if (here := await _abort_in(lanes, request_id)) is not None:
            return here
        if not await self.redis.exists(self.keys.log(request_id)):
            raise CommandRefused("not_found", f"request {request_id!r} is unknown or expired")
        if model is not None:
            # Where a request waits says nothing of its model: ending it there could end
            # another model's job. The marker, which names the model, ends it when one of the
            # model's workers takes it; another model's workers let it run.
            finished = await self.redis.exists(self.keys.finished(request_id))
            return {"aborted": False, "state": "finished" if finished else "elsewhere"}
        state = await self.lanes[0].runner.end_waiting(request_id)
        # Begun meanwhile, maybe here (a delivery that was on its way): stop it here.
        if state == "elsewhere" and (here := await _abort_in(lanes, request_id)) is not None:
            return here
        return {"aborted": state == "queued", "state": state}

    async def _stop_aborted(self) -> None:
        """Stop running jobs whose abort marker is set: the marker alone (without the control
        command, which may have gone to a worker that was not listening) stops a job within
        ``ABORT_POLL_SECONDS``. Also catches a command that arrived while the job was between
        its start checks and the engine. One round trip for all of them."""
        running = [(lane, rid) for lane in self.lanes for rid in lane.runner.in_flight]
        markers = await get_each(self.redis, [self.keys.abort(rid) for _, rid in running])
        for (lane, request_id), marker in zip(running, markers, strict=True):
            if marker_stops(marker, lane.name) and await lane.runner.abort(request_id):
                log.info("job_aborted_by_marker", request_id=request_id)

    # -- periodic ----------------------------------------------------------------------------

    def _supervised(self, name: str, start: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """A task that never dies silently: an unexpected error (Redis refusing a command
        after an ACL change, a bug) is logged at once and the task restarts with backoff;
        while it is down, ``down`` names it (the heartbeat then offers no slot it feeds)."""
        return asyncio.create_task(supervise(name, start, down=self.down), name=name)

    def _periodic(
        self, seconds: float, action: Callable[[], Awaitable[None]], name: str | None = None
    ) -> asyncio.Task[None]:
        """A supervised task that runs ``action`` every ``seconds`` and waits out Redis
        failures (a refusal restarts it)."""
        name = name or getattr(action, "__name__", "periodic").strip("_")
        outage = Outage(name)
        return self._supervised(name, functools.partial(self._every, seconds, action, outage))

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
                for queue in self.queues:
                    await queue.recreate_group_if_lost(exc)
            else:
                outage.recovered()
            await asyncio.sleep(seconds)

    def heartbeat(self) -> Heartbeat:
        """What the heartbeat advertises: no free slot of a lane whose job reader is down
        (restarting after a failure) or whose engine stopped, since nothing would fill it."""
        models = {}
        for lane in self.lanes:
            served = lane.served()
            if _consumer(lane) in self.down or not lane.engine.is_running():
                served = dataclasses.replace(served, free_slots=0)
            models[lane.name] = served
        return Heartbeat(
            worker_id=self.settings.worker_id,
            pid=os.getpid(),
            started_at=self.started_at,
            in_flight=self.in_flight,
            default_model=self.forwarder.default_model,
            models=models,
            version=WORKER_VERSION,
        )

    async def _heartbeat(self) -> None:
        """Claim, heartbeat and activity in one command (one hash slot: the worker id's),
        then the registry."""
        worker_id = self.settings.worker_id
        beat, activity = self.heartbeat(), self.activity()
        writes = [
            (self.keys.worker(worker_id), beat.encode()),
            (self.keys.activity(worker_id), activity.encode()),
        ]
        try:
            renewed = await self.claim.renew(writes)
        except WorkerIdHeld as exc:
            # Two live workers under one id must not both serve: this one stops (its jobs
            # are left to their leases) and touches nothing of the id on its way out.
            log.error("worker_id_lost", error=str(exc))
            self.id_lost_to = str(exc)
            self._stop.set()
            return
        if renewed.written:
            self._activity_written = (activity.buckets, activity.requests)
            self._activity_written_at = time.monotonic()
        else:
            # A full Redis (noeviction) kept the last beat alive; it refuses the registry
            # too, and then prunes nobody: the member written last time stays.
            return
        models = tuple(beat.models)
        if not self.registry.due(models, renewed.existed, time.monotonic()):
            return
        # After the key, so a reader that finds the member finds the heartbeat.
        with contextlib.suppress(OutOfMemoryError):
            registration = await register_worker(
                self.redis,
                self.keys,
                worker_id,
                int(self.settings.heartbeat_ttl * 1000),
                list(models),
            )
            self.registry.registered(models, registration.workers, time.monotonic())
            self.registered.set()
            for key in registration.replaced:
                log.warning("registry_key_repaired", key=key, found="a key of another type")

    def activity(self) -> Activity:
        history = self.publisher.token_history
        return Activity(
            worker_id=self.settings.worker_id,
            at=time.time(),
            bucket_seconds=history.bucket_seconds,
            buckets=history.buckets(),
            requests=tuple(self.publisher.running()),
        )

    async def _activity(self) -> None:
        """Written when it changed, else with the heartbeat (in its command; its TTL is the
        heartbeat's): an idle worker costs Redis no write of its own, not one per
        ``activity_interval`` (with a thousand workers, most of the idle fleet's writes).
        Best effort: a full Redis (noeviction) refuses it, and dashboards do without."""
        activity = self.activity()
        shown = (activity.buckets, activity.requests)
        now = time.monotonic()
        # The heartbeat rewrites it; this is a fallback should a heartbeat be late.
        fresh = now - self._activity_written_at < self.settings.heartbeat_ttl / 2
        if shown == self._activity_written and fresh:
            return
        key = self.keys.activity(self.settings.worker_id)
        ttl_ms = int(self.settings.heartbeat_ttl * 1000)
        try:
            await self.redis.set(key, activity.encode(), px=ttl_ms)
        except OutOfMemoryError:
            return
        self._activity_written, self._activity_written_at = shown, now

    async def stats(self, model: str | None) -> dict[str, Any]:
        """The worker's figures for the ``stats`` reply: per model (only ``model``'s when
        given), and the first of those at the top level as well, as before models."""
        lanes = self.lanes_for(model)
        per_model = {lane.name: await lane.stats() for lane in lanes}
        first = per_model[lanes[0].name] if lanes else {}
        return {
            **{key: first.get(key) for key in ("engine", "prefix_cache", "group")},
            **({"tenants": first["tenants"]} if "tenants" in first else {}),
            "jobs": _jobs_total(per_model.values()),
            "models": per_model,
            "default_model": self.forwarder.default_model,
            "forwarded": self.forwarder.forwarded,
            "worker_id": self.settings.worker_id,
            "publisher": plain(self.publisher.stats()),
            "memory": await self._memory(lanes),
            "uptime_seconds": time.time() - self.started_at,
        }

    async def _memory(self, lanes: list[ModelLane]) -> dict[str, Any]:
        """The process's resident memory and MLX's allocator figures (one allocator for every
        engine of the process). MLX is asked on an engine thread (the one thread that touches
        that engine's MLX work), between two steps; a step longer than a second (a long
        prefill) leaves them out rather than hold up the reply."""
        memory: dict[str, Any] = {"rss_bytes": _rss_bytes()}
        if not lanes:
            return memory
        try:
            mlx = await lanes[0].engine.memory_stats_async(1.0)
        except Exception as exc:  # engine stopped, or busy past the timeout: say so, don't fail
            memory["mlx_error"] = f"{type(exc).__name__}: {exc}"
        else:
            memory.update(
                mlx_active_memory_bytes=mlx.active_bytes,
                mlx_cache_memory_bytes=mlx.cache_bytes,
                mlx_peak_memory_bytes=mlx.peak_bytes,
            )
        return memory


def _consumer(lane: ModelLane) -> str:
    """The name of a lane's job reader task."""
    return f"consumer {lane.name}"


def _jobs_total(lanes: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The lanes' ``jobs`` figures added up."""
    in_flight: list[str] = []
    outcomes: Counter[str] = Counter()
    for lane in lanes:
        in_flight += lane["jobs"]["in_flight"]
        outcomes.update(lane["jobs"]["outcomes"])
    return {"in_flight": in_flight, "outcomes": dict(outcomes)}


def _rss_bytes() -> int | None:
    """Resident set size from /proc (Linux); None where there is no /proc. statm's second
    field (pages), not status' VmRSS line: one short line instead of fifty to parse, for
    every stats reply."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
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


async def _abort_in(lanes: list[ModelLane], request_id: str) -> dict[str, Any] | None:
    """The reply of the first of ``lanes`` where the request runs or waits (stopped there);
    None when it is in none of them."""
    for lane in lanes:
        if (here := await lane.abort_here(request_id)) is not None:
            return here
    return None
