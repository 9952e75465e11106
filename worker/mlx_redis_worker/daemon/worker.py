"""The worker daemon: from a process start to serving, and back to a clean stop.

Redis first (a wrong password, a missing permission or an evicting Redis fails before a model
load that can take minutes; an unreachable Redis is waited for, up to ``redis_start_timeout`` or
a stop request, whichever comes first), then the
models, each with its engine (on its own thread), then the collaborators, wired here and
nowhere else, and ``Serving`` runs until told to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from mlx_redis_protocol.channels import ChannelHub
from mlx_redis_protocol.connection import RedisClient, connect, redact
from mlx_redis_protocol.keys import JobStream, Keys
from mlx_redis_protocol.limits import DEFAULT_LIMITS, Limits
from mlx_redis_protocol.permissions import redis_user
from mlx_redis_protocol.redis_retry import REDIS_FAILURES, describe, retry_until_done
from mlx_redis_worker.daemon.claim import WorkerClaim
from mlx_redis_worker.daemon.control import ControlListener
from mlx_redis_worker.daemon.eviction import check_eviction_policy
from mlx_redis_worker.daemon.fair_queue import FairQueue
from mlx_redis_worker.daemon.forwarder import DefaultStreamForwarder
from mlx_redis_worker.daemon.job_queue import JobQueue
from mlx_redis_worker.daemon.jobs import JobRunner, speculative_params
from mlx_redis_worker.daemon.lane import ModelLane
from mlx_redis_worker.daemon.media_loader import MediaLoader
from mlx_redis_worker.daemon.media_pool import MediaPool
from mlx_redis_worker.daemon.memory_fit import check_fit
from mlx_redis_worker.daemon.metrics import Metrics
from mlx_redis_worker.daemon.permissions import check_permissions
from mlx_redis_worker.daemon.publisher import EventPublisher
from mlx_redis_worker.daemon.serving import Serving
from mlx_redis_worker.daemon.settings import WorkerSettings, parse_speculative
from mlx_redis_worker.engine.config import (
    DEFAULT_MAX_PREFILL_STALL,
    DraftModel,
    EngineConfig,
    GrammarLimits,
    SchedulerConfig,
)
from mlx_redis_worker.models.loading import ModelUnavailable

if TYPE_CHECKING:
    from mlx_redis_worker.engine import AnyEngine
    from mlx_redis_worker.engine.embedding_model import EmbeddingModel

log = structlog.get_logger(__name__)
T = TypeVar("T")

BACKLOG_READ_LIMIT = 100_000


class RedisNeverAnswered(Exception):
    """Redis did not answer (or kept failing) for ``redis_start_timeout`` seconds at start: the
    worker exits for its supervisor to start it again, rather than wait unseen forever."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model to serve: a text model (``model``, ``tokenizer``) or an embedding model
    (``embedding``; a sentence-transformers folder)."""

    name: str
    source: str
    model: Any
    tokenizer: Any
    embedding: EmbeddingModel | None = None


def scheduler_config(
    *,
    max_concurrency: int,
    limits: Limits,
    grammar_limits: GrammarLimits | None = None,
    max_prefill_stall: float = DEFAULT_MAX_PREFILL_STALL,
) -> SchedulerConfig:
    """The engine's batch for a worker. The caps a job meets twice (the decoder, then the
    engine) are the wire's, so the engine never refuses for another number what the decoder
    let through."""
    return SchedulerConfig(
        max_num_seqs=max_concurrency,
        max_waiting_requests=max_concurrency,
        max_prompt_tokens=limits.max_prompt_tokens,
        max_logprobs=limits.max_logprobs,
        grammar_limits=grammar_limits or GrammarLimits(),
        max_prefill_stall=max_prefill_stall,
    )


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        *,
        model_and_tokenizer: tuple[Any, Any] | None = None,
        engines: Mapping[str, AnyEngine] | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        """``model_and_tokenizer``: an already loaded model, served as the settings' first
        (else every model of ``settings.model`` is loaded); ``engines``: engines made
        already, by the name of the model each serves (a simulated fleet's stand-ins, see
        bench/fleet_engine.py), served instead of loading anything; ``on_ready`` is called
        once the worker serves (``ready`` is set too)."""
        self.settings = settings
        self.keys = Keys(settings.prefix)
        self._model_and_tokenizer = model_and_tokenizer
        self._given_engines = engines
        self._on_ready = on_ready
        self._stop = asyncio.Event()
        self.started_at = time.time()
        self.ready = asyncio.Event()
        # Every lane's jobs decode their images and videos here (tenants take turns).
        self.media_pool = MediaPool(settings.media_threads)
        # The latest failure of a Redis call at start, for the line RedisNeverAnswered says.
        self._start_failure: BaseException | None = None

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> int:
        settings = self.settings
        # One deadline for everything asked of Redis before serving; outages after the start
        # are ridden through (retried with backoff) however long they last.
        deadline = (
            asyncio.get_running_loop().time() + settings.redis_start_timeout
            if settings.redis_start_timeout > 0
            else None
        )
        redis = await self._unless_stopped(
            self._in_time(
                deadline,
                retry_until_done(self._connect, "connect", on_failure=self._start_failed),
            )
        )
        if redis is None:
            log.info("worker_stopped_before_serving", waiting_for="redis")
            return 0
        hub = ChannelHub(redis)
        claim = WorkerClaim(
            redis=redis,
            keys=self.keys,
            worker_id=settings.worker_id,
            ttl_ms=int(settings.heartbeat_ttl * 1000),
        )
        forwarding = self._queue(redis, self.keys.default_stream)
        queues = {
            m.name: self._queue(redis, self.keys.model_stream(m.name)) for m in settings.models
        }
        engines: dict[str, AnyEngine] = {}
        try:
            if not await self._unless_stopped(
                self._in_time(
                    deadline, self._check_redis(redis, [forwarding, *queues.values()], claim)
                )
            ):
                log.info("worker_stopped_before_serving", waiting_for="redis")
                return 0
            if self._given_engines is not None:
                engines.update(self._given_engines)
            elif not self._load_engines(engines):
                log.info("worker_stopped_before_serving", waiting_for="model")
                return 0
            return await self._serve(redis, hub, forwarding, queues, engines, claim)
        finally:
            for engine in engines.values():
                engine.close()
            # Only while it is ours: a worker refused for a held id leaves the holder's alone.
            with contextlib.suppress(*REDIS_FAILURES):
                await claim.release()
            await hub.aclose()
            await redis.aclose()

    def _load_engines(self, engines: dict[str, AnyEngine]) -> bool:
        """Load each model into ``engines`` (an engine each); False when a stop request came
        first (what was made is in ``engines``, for the caller to close). The engines, and MLX
        with them, are imported here: a worker handed its engines (a simulated fleet's) runs
        without MLX."""
        from mlx_redis_worker.engine import EmbeddingEngineCore, EngineCore
        from mlx_redis_worker.engine.embedding_scheduler import EmbeddingLimits
        from mlx_redis_worker.engine.speculative_batch import check_draft_model

        settings = self.settings
        scheduler = scheduler_config(
            max_concurrency=settings.max_concurrency,
            limits=DEFAULT_LIMITS,
            grammar_limits=settings.grammar_limits,
            max_prefill_stall=settings.max_prefill_stall,
        )
        draft = self._draft_model()
        for served in self._loaded_models():
            if self._stop.is_set():
                return False
            if served.embedding is not None:
                engines[served.name] = EmbeddingEngineCore(
                    served.embedding,
                    EngineConfig(model_name=served.source, scheduler_config=scheduler),
                    EmbeddingLimits(max_waiting_requests=scheduler.max_waiting_requests),
                )
                continue
            if draft is not None:
                try:
                    check_draft_model(served.model, served.tokenizer, draft)
                except ValueError as exc:
                    raise ModelUnavailable(f"model {served.name!r}: {exc}") from exc
            engines[served.name] = EngineCore(
                served.model,
                served.tokenizer,
                EngineConfig(model_name=served.source, scheduler_config=scheduler, draft=draft),
            )
        return True

    def _queue(self, redis: RedisClient, stream: JobStream) -> JobQueue:
        settings = self.settings
        return JobQueue(
            redis=redis,
            stream=stream,
            consumer=settings.worker_id,
            lease_ms=int(settings.lease_seconds * 1000),
            dead_letter_maxlen=settings.dead_letter_maxlen,
        )

    def _draft_model(self) -> DraftModel | None:
        """The draft model of speculative draft_model, when the settings name one."""
        from mlx_redis_worker.models.loading import load_model

        name = self.settings.draft_model
        if not name:
            return None
        model, tokenizer = load_model(name)
        log.info("draft_model_loaded", draft_model=name)
        return DraftModel(name, model, tokenizer)

    def _loaded_models(self) -> Iterator[LoadedModel]:
        """Each model to serve, loaded in turn, after checking that all their weights fit."""
        from mlx_redis_worker.models.embedding import is_embedding_model, load_embedding_model
        from mlx_redis_worker.models.loading import load_model

        models = self.settings.models
        if self._model_and_tokenizer is not None:  # tests hand in one model, loaded already
            model, tokenizer = self._model_and_tokenizer
            yield LoadedModel(models[0].name, models[0].source, model, tokenizer)
            return
        check_fit(models, limit_mb=self.settings.memory_limit_mb)
        for served in models:
            if is_embedding_model(served.source):
                embedding = load_embedding_model(served.source)
                log.info("model_loaded", model=served.name, source=served.source, kind="embedding")
                yield LoadedModel(
                    served.name, served.source, embedding.model, embedding.tokenizer, embedding
                )
                continue
            model, tokenizer = load_model(served.source)
            log.info("model_loaded", model=served.name, source=served.source)
            yield LoadedModel(served.name, served.source, model, tokenizer)

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

    async def _in_time(self, deadline: float | None, step: Awaitable[T]) -> T:
        """The start step's result, or RedisNeverAnswered once the start deadline passes."""
        try:
            async with asyncio.timeout_at(deadline) as timer:
                return await step
        except TimeoutError as exc:
            if not timer.expired():  # a TimeoutError of the step's own: not the deadline
                raise
            last = self._start_failure
            raise RedisNeverAnswered(
                f"Redis at {redact(self.settings.redis_url)} did not answer within "
                f"{self.settings.redis_start_timeout:g} s of the start"
                + (f" ({describe(last)})" if last is not None else "")
                + "; exiting for the service manager to start the worker again "
                "(redis_start_timeout)"
            ) from exc

    async def _start_failed(self, exc: Exception) -> None:
        self._start_failure = exc

    async def _check_redis(
        self, redis: RedisClient, queues: list[JobQueue], claim: WorkerClaim
    ) -> bool:
        """Everything the worker needs from Redis, before it loads the model: a policy that
        keeps its keys, every command it will send, its worker id (WorkerIdHeld while a live
        worker holds it) and the consumer group."""
        settings = self.settings
        await retry_until_done(
            lambda: check_eviction_policy(
                redis, redact(settings.redis_url), allow=settings.allow_eviction
            ),
            "check maxmemory-policy",
            on_failure=self._start_failed,
        )
        await retry_until_done(
            lambda: check_permissions(
                redis,
                self.keys,
                settings.worker_id,
                redis_user(settings.redis_url),
                settings.dead_letter_maxlen,
                tuple(m.name for m in settings.models) if settings.fair_share else (),
                models=[served.name for served in settings.models],
            ),
            "check permissions",
            on_failure=self._start_failed,
        )
        await retry_until_done(claim.acquire, "claim the worker id", on_failure=self._start_failed)
        for queue in queues:
            await retry_until_done(
                queue.ensure_group,
                f"create the group of {queue.stream.stream}",
                on_failure=self._start_failed,
            )
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
        self,
        redis: RedisClient,
        hub: ChannelHub,
        forwarding: JobQueue,
        queues: dict[str, JobQueue],
        engines: dict[str, AnyEngine],
        claim: WorkerClaim,
    ) -> int:
        """Wire the collaborators around the engines and serve until stopped."""
        settings = self.settings
        # Again, before the lanes take this id's pending jobs: a model load can outlast the
        # claim's TTL, and another worker may have started under the id meanwhile.
        await retry_until_done(claim.acquire, "claim the worker id")
        metrics = Metrics(settings.metrics_port) if settings.metrics_port is not None else None
        publisher = EventPublisher(
            redis=redis,
            keys=self.keys,
            log_ttl=settings.log_ttl,
            on_done=metrics.observe_done if metrics is not None else None,
        )
        # The default model's lane first: stats and old readers of one model see that one.
        default = settings.default_model_name
        names = sorted(engines, key=lambda name: name != default)
        try:
            lanes: list[ModelLane] = []
            # What fair share charges a tenant: its jobs' service (prompt tokens computed and
            # tokens generated), whichever lane's.
            publisher.on_closed = lambda request_id, tokens: self._closed(lanes, request_id, tokens)
            for name in names:
                engine, queue = engines[name], queues[name]
                engine.set_step_listener(publisher.on_step)
                await engine.start()
                lanes.append(await self._lane(name, engine, queue, redis, publisher))
            if metrics is not None:
                metrics.start()
            serving = Serving(
                settings=settings,
                redis=redis,
                keys=self.keys,
                lanes=lanes,
                forwarder=DefaultStreamForwarder(
                    redis=redis,
                    keys=self.keys,
                    queue=forwarding,
                    default_model=default,
                    read_block_ms=settings.read_block_ms,
                    marker_ttl=settings.log_ttl,
                    stop=self._stop,
                ),
                publisher=publisher,
                metrics=metrics,
                stop=self._stop,
                started_at=self.started_at,
                claim=claim,
            )
            control = ControlListener(
                redis=redis,
                hub=hub,
                keys=self.keys,
                worker_id=settings.worker_id,
                engines=engines,
                cache_dir=settings.cache_path,
                reply_ttl=settings.reply_ttl,
                limits=DEFAULT_LIMITS,
                abort_job=serving.abort,
                stats=serving.stats,
            )
            status = await serving.serve(control, on_ready=self._became_ready)
            for engine in engines.values():
                await engine.stop()
            log.info("worker_stopped")
            return status
        finally:
            self.media_pool.close()
            if metrics is not None:
                metrics.close()

    async def _lane(
        self,
        name: str,
        engine: AnyEngine,
        queue: JobQueue,
        redis: RedisClient,
        publisher: EventPublisher,
    ) -> ModelLane:
        settings = self.settings
        runner = JobRunner(
            engine=engine,
            redis=redis,
            keys=self.keys,
            queue=queue,
            publisher=publisher,
            limits=settings.limits,
            max_deliveries=settings.max_deliveries,
            default_stream_interval=settings.stream_interval,
            default_speculative=speculative_params(parse_speculative(settings.speculative)),
            worker_id=settings.worker_id,
            model=name,
            idempotency_seconds=settings.idempotency_seconds,
            media=MediaLoader(
                redis=redis,
                keys=self.keys,
                limits=settings.limits,
                pool=self.media_pool,
                fetch=settings.fetch_policy,
            ),
        )
        backlog = await retry_until_done(
            lambda: queue.read_own_pending(BACKLOG_READ_LIMIT), "read own pending"
        )
        fair = None
        if settings.fair_share:
            fair = FairQueue(
                redis=redis,
                stream=queue.stream,
                keys=self.keys.fair(name),
                consumer=settings.worker_id,
                tenant_weights_key=self.keys.tenant_weights,
                age_bound_seconds=settings.priority_age_seconds,
            )
            await retry_until_done(fair.refresh_weights, "read tenant weights")
        return ModelLane(
            name=name,
            engine=engine,
            queue=queue,
            runner=runner,
            max_concurrency=settings.max_concurrency,
            read_block_ms=settings.read_block_ms,
            backlog=backlog,
            stop=self._stop,
            fair=fair,
        )

    @staticmethod
    def _closed(lanes: list[ModelLane], request_id: str, tokens: int) -> None:
        for lane in lanes:
            if lane.fair is not None:
                lane.fair.closed(request_id, tokens)

    def _became_ready(self) -> None:
        self.ready.set()
        if self._on_ready is not None:
            self._on_ready()
