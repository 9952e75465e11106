"""One model's lane through a worker: its job stream, its engine and the jobs between them.

A worker serves each of its models in a lane of its own: the lane reads the model's stream
(``mlxw:jobs:{model}``) only as fast as the model's engine has free slots, takes over jobs
whose worker died (XAUTOCLAIM), keeps the leases of its running jobs, and on a stop drains
them. Lanes share the worker's Redis connection, publisher, heartbeat and control channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import TYPE_CHECKING, Any

import structlog

from mlx_redis_protocol.codec_job import readable_request_id
from mlx_redis_protocol.heartbeat import ServedModel
from mlx_redis_protocol.redis_retry import REDIS_FAILURES, describe, retry_until_done
from mlx_redis_worker.daemon.fair_queue import (
    FAIR_CONSUMER,
    INTAKE_EVERY_MS,
    INTAKE_WHILE_BUSY,
    Charge,
    FairQueue,
)
from mlx_redis_worker.daemon.job_queue import Delivery, JobQueue
from mlx_redis_worker.daemon.jobs import JobRunner
from mlx_redis_worker.daemon.media_loader import engine_media
from mlx_redis_worker.engine.stats import plain

if TYPE_CHECKING:
    from mlx_redis_worker.engine import AnyEngine

log = structlog.get_logger(__name__)


class ModelLane:
    def __init__(
        self,
        *,
        name: str,
        engine: AnyEngine,
        queue: JobQueue,
        runner: JobRunner,
        max_concurrency: int,
        read_block_ms: int,
        backlog: list[Delivery],
        stop: asyncio.Event,
        fair: FairQueue | None = None,
    ) -> None:
        """``backlog``: jobs already delivered to this consumer (a restart under the same id),
        run before new ones; ``stop``: set when the worker stops reading; ``fair``: new jobs
        come from the fair pick (fair share between tenants) instead of the stream's order."""
        self.name = name
        self.engine = engine
        self.queue = queue
        self.runner = runner
        self.max_concurrency = max_concurrency
        self.read_block_ms = read_block_ms
        self.backlog = backlog
        self._stop = stop
        self.fair = fair
        self._charges: dict[str, Charge] = {}  # picked, not started yet: by entry id
        self._slot_freed = asyncio.Event()
        self.jobs: dict[str, asyncio.Task[None]] = {}  # entry id -> task

    # -- reading jobs ------------------------------------------------------------------------

    async def consume(self) -> None:
        while not self._stop.is_set():
            free = self.max_concurrency - len(self.jobs)
            if free <= 0:
                self._slot_freed.clear()
                await self._wait_for_a_slot()
                continue
            if self.backlog:
                batch, self.backlog = self.backlog[:free], self.backlog[free:]
                self.start(batch)
                continue
            deliveries = await retry_until_done(
                functools.partial(self._read_new, free),
                f"read jobs of {self.name}",
                on_failure=self.queue.recreate_group_if_lost,
            )
            if self._stop.is_set():
                # Stopping, and the cancel of this task was lost (redis-py can swallow one
                # that lands as its read completes): start nothing more. What this read took
                # stays pending for us: a restart or another worker's reclaim runs it.
                return
            self.start(deliveries)

    async def _wait_for_a_slot(self) -> None:
        """Until a slot frees. With fair share, new jobs are filed in their tenants' queues
        meanwhile (every INTAKE_EVERY_MS, or read_block_ms if shorter), and finished jobs'
        tokens settled, so the next pick sees every tenant that waits."""
        if self.fair is None:
            await self._slot_freed.wait()
            return
        fair = self.fair
        # Not read_block_ms itself: that is an idle worker's re-read, made long so an idle
        # fleet costs Redis little; a busy worker's intake is what keeps the fair queue current.
        every = min(self.read_block_ms, INTAKE_EVERY_MS) / 1000
        while not self._slot_freed.is_set() and not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slot_freed.wait(), every)
                return
            await retry_until_done(
                functools.partial(fair.pick, 0, intake=INTAKE_WHILE_BUSY),
                f"file new jobs of {self.name}",
                on_failure=self.queue.recreate_group_if_lost,
            )

    async def _read_new(self, free: int) -> list[Delivery]:
        if self.fair is None:
            return await self.queue.read_new(free, self.read_block_ms)
        picked = await self.fair.pick(free)
        if not picked.deliveries:
            await self.fair.wait_for_new(picked.last_id, self.read_block_ms)
        self._charges.update(picked.charges)
        return picked.deliveries

    async def reclaim(self) -> None:
        """Take over jobs whose worker died (or gave the attempt up). Also while every slot is
        busy: what does not fit waits in the backlog, leases kept, and the consumer serves the
        backlog before reading new jobs. So orphaned jobs, older than anything new, run next
        instead of waiting until the stream runs dry."""
        self.start(await self.runner.unpark())
        room = self.max_concurrency - len(self.backlog)
        if self.fair is not None:
            await self.fair.refresh_weights()
            await self.fair.sweep()
        if room > 0:
            if self.fair is None:
                claimed = await self.queue.reclaim(room)
            else:  # jobs waiting for a fair pick are idle by design, not orphaned
                claimed = await self.queue.reclaim_except(FAIR_CONSUMER, room)
            if claimed:
                log.info("jobs_reclaimed", model=self.name, count=len(claimed))
            self.start(claimed)

    async def extend_leases(self) -> None:
        held = {*self.jobs, *(d.entry_id for d in self.backlog), *self.runner.parked}
        lost = await self.queue.extend_leases(sorted(held))
        # A job that ended meanwhile (its entry acknowledged) is gone from our pending list,
        # and not lost.
        lost = [entry_id for entry_id in lost if not self.queue.settled(entry_id)]
        if lost:
            log.warning("leases_lost", model=self.name, entries=lost)
            self.backlog = [d for d in self.backlog if d.entry_id not in lost]
            for entry_id in lost:
                self._charges.pop(entry_id, None)
            self.runner.lose_entries(lost)

    def start(self, deliveries: list[Delivery], *, now: bool = False) -> None:
        """Run the deliveries, as many as there are free slots (``now``: all of them; for jobs
        that end before they reach the engine) and keep the rest in the backlog."""
        for delivery in deliveries:
            if delivery.entry_id in self.jobs:
                continue
            if len(self.jobs) >= self.max_concurrency and not now:
                # The consumer's read and the reclaimer both sized their batch from the same
                # free slots: what does not fit waits in the backlog (ours, its lease kept)
                # instead of overfilling the engine, whose full queue would fail the job.
                if all(d.entry_id != delivery.entry_id for d in self.backlog):
                    self.backlog.append(delivery)
                continue
            if self.fair is not None:
                self.fair.started(delivery, self._charges.pop(delivery.entry_id, None))
            task = asyncio.create_task(self.runner.run(delivery))
            self.jobs[delivery.entry_id] = task
            task.add_done_callback(functools.partial(self._job_done, delivery.entry_id))

    def _job_done(self, entry_id: str, task: asyncio.Task[None]) -> None:
        self.jobs.pop(entry_id, None)
        if self.fair is not None:
            self.fair.ended(entry_id)
        self._slot_freed.set()
        if not task.cancelled() and (failure := task.exception()) is not None:
            log.error("job_task_failed", entry_id=entry_id, error=describe(failure))

    # -- aborts ------------------------------------------------------------------------------

    async def abort_here(self, request_id: str) -> dict[str, Any] | None:
        """Stop the request if it runs or waits in this lane; None when it is not here."""
        if self.runner.running(request_id):
            if await self.runner.abort(request_id):
                return {"aborted": True, "state": "running"}
            # It ended between the look and the abort: too late to stop, as for any finished
            # request (never the pair aborted false / running).
            return {"aborted": False, "state": "finished"}
        waiting = [d for d in self.backlog if readable_request_id(d.job_bytes) == request_id]
        if waiting:  # ours, waiting for a slot: it starts, sees its marker and ends at once
            self.backlog = [d for d in self.backlog if d not in waiting]
            self.start(waiting, now=True)
            return {"aborted": True, "state": "queued"}
        return None

    # -- stopping ----------------------------------------------------------------------------

    async def drain(self, timeout: float) -> None:
        """Let running jobs finish for ``timeout`` seconds, then abandon the rest (not
        acknowledged: another worker re-runs them)."""
        jobs = list(self.jobs.values())
        if jobs:
            _, still_running = await asyncio.wait(jobs, timeout=timeout)
            if still_running:
                log.warning("drain_timeout_abandoning", model=self.name, jobs=len(still_running))
                await self.runner.abandon_all()
                await asyncio.wait(still_running, timeout=10)

    # -- reporting ---------------------------------------------------------------------------

    def served(self) -> ServedModel:
        """What the heartbeat advertises of this lane."""
        in_flight = len(self.jobs)
        return ServedModel(
            max_concurrency=self.max_concurrency,
            free_slots=max(self.max_concurrency - in_flight, 0),
            in_flight=in_flight,
            media=engine_media(self.engine),
        )

    async def stats(self) -> dict[str, Any]:
        """The lane's part of the ``stats`` reply."""
        try:
            group: dict[str, Any] = await self.queue.group_info()
        except REDIS_FAILURES as exc:
            group = {"error": describe(exc)}
        cache = self.engine.cache_stats()
        stats: dict[str, Any] = {
            "engine": self.engine.stats().as_dict(),
            "prefix_cache": cache.as_dict() if cache is not None else None,
            "jobs": plain(self.runner.stats()),
            "group": group,
            "stream": self.queue.stream.stream,
        }
        if self.fair is not None:
            stats["tenants"] = await self.tenant_shares()
        if self.runner.media is not None:
            media = self.runner.media
            # The pool is the worker's (every lane's jobs decode there); the counts this lane's.
            stats["media"] = {
                **plain(media.counts),
                "pool": plain(media.pool.stats),
            }
        return stats

    async def tenant_shares(self) -> list[dict[str, Any]] | dict[str, str]:
        """Fair share by tenant (waiting, running here, tokens served), or the error that
        kept Redis from telling."""
        assert self.fair is not None
        try:
            return await self.fair.shares()
        except REDIS_FAILURES as exc:
            return {"error": describe(exc)}
