"""The worker daemon: from a process start to serving, and back to a clean stop.

Redis first (a wrong password, a missing permission or an evicting Redis fails before a model
load that can take minutes; an unreachable Redis is waited for, until a stop request), then the
model and its engine (on its own thread), then the collaborators, wired here and nowhere else,
and ``Serving`` runs until told to stop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog

from protocol.channels import ChannelHub
from protocol.connection import RedisClient, connect, redact
from protocol.keys import Keys
from protocol.limits import DEFAULT_LIMITS, Limits
from worker.daemon.control import ControlListener
from worker.daemon.eviction import check_eviction_policy
from worker.daemon.job_queue import JobQueue
from worker.daemon.jobs import JobRunner
from worker.daemon.metrics import Metrics
from worker.daemon.permissions import check_permissions, redis_user
from worker.daemon.publisher import EventPublisher
from worker.daemon.redis_retry import retry_until_done
from worker.daemon.serving import Serving
from worker.daemon.settings import WorkerSettings
from worker.engine import EngineConfig, EngineCore, SchedulerConfig
from worker.models import load_model

log = structlog.get_logger(__name__)
T = TypeVar("T")

BACKLOG_READ_LIMIT = 100_000


def scheduler_config(*, max_concurrency: int, limits: Limits) -> SchedulerConfig:
    """The engine's batch for a worker. The caps a job meets twice (the decoder, then the
    engine) are the wire's, so the engine never refuses for another number what the decoder
    let through."""
    return SchedulerConfig(
        max_num_seqs=max_concurrency,
        max_waiting_requests=max_concurrency,
        max_prompt_tokens=limits.max_prompt_tokens,
        max_logprobs=limits.max_logprobs,
    )


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        *,
        model_and_tokenizer: tuple[Any, Any] | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        """``model_and_tokenizer``: an already loaded model (else ``settings.model`` is
        loaded); ``on_ready`` is called once the worker serves (``ready`` is set too)."""
        self.settings = settings
        self.keys = Keys(settings.prefix)
        self._model_and_tokenizer = model_and_tokenizer
        self._on_ready = on_ready
        self._stop = asyncio.Event()
        self.started_at = time.time()
        self.ready = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> int:
        settings = self.settings
        redis = await self._unless_stopped(retry_until_done(self._connect, "connect"))
        if redis is None:
            log.info("worker_stopped_before_serving", waiting_for="redis")
            return 0
        hub = ChannelHub(redis)
        queue = JobQueue(
            redis=redis,
            keys=self.keys,
            consumer=settings.worker_id,
            lease_ms=int(settings.lease_seconds * 1000),
            dead_letter_maxlen=settings.dead_letter_maxlen,
        )
        try:
            if not await self._unless_stopped(self._check_redis(redis, queue)):
                log.info("worker_stopped_before_serving", waiting_for="redis")
                return 0
            model, tokenizer = self._model_and_tokenizer or load_model(settings.model)
            if self._stop.is_set():
                log.info("worker_stopped_before_serving", waiting_for="model")
                return 0
            scheduler = scheduler_config(
                max_concurrency=settings.max_concurrency, limits=DEFAULT_LIMITS
            )
            engine = EngineCore(
                model,
                tokenizer,
                EngineConfig(model_name=settings.model, scheduler_config=scheduler),
            )
            try:
                return await self._serve(redis, hub, queue, engine)
            finally:
                engine.close()
        finally:
            await hub.aclose()
            await redis.aclose()

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

    async def _check_redis(self, redis: RedisClient, queue: JobQueue) -> bool:
        """Everything the worker needs from Redis, before it loads the model: a policy that
        keeps its keys, every command it will send, and the consumer group."""
        settings = self.settings
        await retry_until_done(
            lambda: check_eviction_policy(
                redis, redact(settings.redis_url), allow=settings.allow_eviction
            ),
            "check maxmemory-policy",
        )
        await retry_until_done(
            lambda: check_permissions(
                redis,
                self.keys,
                settings.worker_id,
                redis_user(settings.redis_url),
                settings.dead_letter_maxlen,
            ),
            "check permissions",
        )
        await retry_until_done(queue.ensure_group, "create consumer group")
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

    async def _serve(
        self, redis: RedisClient, hub: ChannelHub, queue: JobQueue, engine: EngineCore
    ) -> int:
        """Wire the collaborators around the engine and serve until stopped."""
        settings = self.settings
        metrics = Metrics(settings.metrics_port) if settings.metrics_port is not None else None
        publisher = EventPublisher(
            redis=redis,
            keys=self.keys,
            log_ttl=settings.log_ttl,
            on_done=metrics.observe_done if metrics is not None else None,
        )
        runner = JobRunner(
            engine=engine,
            redis=redis,
            keys=self.keys,
            queue=queue,
            publisher=publisher,
            limits=DEFAULT_LIMITS,
            max_deliveries=settings.max_deliveries,
            default_stream_interval=settings.stream_interval,
            worker_id=settings.worker_id,
        )
        engine.set_step_listener(publisher.on_step)
        try:
            await engine.start()
            if metrics is not None:
                metrics.start()
            backlog = await retry_until_done(
                lambda: queue.read_own_pending(BACKLOG_READ_LIMIT), "read own pending"
            )
            serving = Serving(
                settings=settings,
                redis=redis,
                keys=self.keys,
                engine=engine,
                queue=queue,
                publisher=publisher,
                runner=runner,
                metrics=metrics,
                backlog=backlog,
                stop=self._stop,
                started_at=self.started_at,
            )
            control = ControlListener(
                redis=redis,
                hub=hub,
                keys=self.keys,
                worker_id=settings.worker_id,
                engine=engine,
                cache_dir=settings.cache_path,
                reply_ttl=settings.reply_ttl,
                limits=DEFAULT_LIMITS,
                abort_job=serving.abort,
                extra_stats=serving.stats,
            )
            status = await serving.serve(control, on_ready=self._became_ready)
            await engine.stop()
            log.info("worker_stopped")
            return status
        finally:
            if metrics is not None:
                metrics.close()

    def _became_ready(self) -> None:
        self.ready.set()
        if self._on_ready is not None:
            self._on_ready()
