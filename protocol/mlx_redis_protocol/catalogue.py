"""The fleet's catalogue: which models live workers serve, and how each model's queue stands.

Read from what the fleet already writes, nothing more: the registry (workers and models, see
`mlx_redis_protocol.registry`), the workers' heartbeat keys (each advertises its models and their
free slots, see `mlx_redis_protocol.heartbeat`) and the job streams (the default one,
``mlxw:jobs``, and one per model, ``mlxw:jobs:{MODEL}``). Nothing scans the keyspace: a read
costs the same round trips with a million unrelated keys in Redis as with none. On a Redis
Cluster the heartbeat keys spread over the nodes: their reads go out as one pipeline, split by
node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from mlx_redis_protocol.connection import RedisClient, as_text
from mlx_redis_protocol.fair_share import TenantShare, tenant_shares
from mlx_redis_protocol.heartbeat import MEDIA_KINDS, Heartbeat, decode_heartbeat
from mlx_redis_protocol.identifiers import is_valid_id
from mlx_redis_protocol.keys import JobStream, Keys
from mlx_redis_protocol.registry import Registered, read_registry


async def heartbeat_values(redis: RedisClient, keys: Keys, workers: Sequence[str]) -> list[Any]:
    """The heartbeat key's value of each registered worker (None: no such key, the worker
    died): one round trip (one per node on a Cluster, where the keys are on different slots).
    A key of another type answers WRONGTYPE, as an error value: it is no heartbeat, and must
    not fail the reads of the ones that are."""
    if not workers:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for worker_id in workers:
            pipe.get(keys.worker(worker_id))
        values: list[Any] = await pipe.execute(raise_on_error=False)
    for value in values:
        if isinstance(value, BaseException) and "WRONGTYPE" not in str(value):
            raise value
    return values


async def count_live(redis: RedisClient, keys: Keys, workers: Sequence[str]) -> int:
    """How many of ``workers`` have a heartbeat key (of any value, or type: the worker may
    well be alive), without reading one: one ``EXISTS`` of every key on a server, a pipeline
    of one ``EXISTS`` per key on a Cluster (one round trip per node, as for the values)."""
    if not workers:
        return 0
    names = [keys.worker(worker_id) for worker_id in workers]
    if not isinstance(redis, RedisCluster):
        return int(await redis.exists(*names))
    async with redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.exists(name)
        found: list[Any] = await pipe.execute()
    return sum(int(count) for count in found)


async def live_worker_ids(redis: RedisClient, keys: Keys) -> list[str]:
    """The registered workers whose heartbeat key exists, sorted."""
    workers = (await read_registry(redis, keys)).workers
    values = await heartbeat_values(redis, keys, workers)
    return sorted(w for w, value in zip(workers, values, strict=True) if value is not None)


async def live_heartbeats(
    redis: RedisClient, keys: Keys, registered: Registered | None = None
) -> list[Heartbeat]:
    """Every live worker's heartbeat, by worker id; values that do not decode are left out."""
    if registered is None:
        registered = await read_registry(redis, keys)
    values = await heartbeat_values(redis, keys, registered.workers)
    beats = [decode_heartbeat(value) for value in values if isinstance(value, bytes | str)]
    return sorted((beat for beat in beats if beat is not None), key=lambda b: b.worker_id)


async def served_models(redis: RedisClient, keys: Keys) -> set[str]:
    """The models live workers advertise in their heartbeats."""
    return set(await served_media(redis, keys))


async def served_media(redis: RedisClient, keys: Keys) -> dict[str, frozenset[str]]:
    """The models live workers advertise, each with the media its jobs may carry ("image",
    "video"; none for a text-only model) as any of its workers says."""
    served: dict[str, frozenset[str]] = {}
    for beat in await live_heartbeats(redis, keys):
        for model, state in beat.models.items():
            served[model] = served.get(model, frozenset()) | frozenset(state.media)
    return served


async def model_streams(redis: RedisClient, keys: Keys) -> list[JobStream]:
    """The job stream of every model in the registry, by model name (whether it exists or
    not: a stream that does not reads as an empty queue)."""
    models = (await read_registry(redis, keys)).models
    return [keys.model_stream(model) for model in sorted(models)]


async def job_streams(redis: RedisClient, keys: Keys) -> list[JobStream]:
    """The default job stream, then every registered model's."""
    return [keys.default_stream, *await model_streams(redis, keys)]


@dataclass(frozen=True, slots=True)
class QueueStatus:
    """One job stream and its group, as Redis sees them. A stream or group that does not
    exist reads as empty: zero counts, no lag, nothing pending."""

    stream: str
    length: int  # XLEN: entries not yet delivered plus those pending (workers delete on ack)
    lag: int | None  # entries not yet delivered to the group; None: unknown (or no group)
    pending: int  # delivered to a worker, not yet acknowledged
    oldest_pending_seconds: float | None  # age of the oldest pending entry's id; None: none
    dead_letters: int  # XLEN of the stream's dead-letter stream
    group: bool  # whether the consumer group exists

    def as_dict(self) -> dict[str, Any]:
        oldest = self.oldest_pending_seconds
        return {
            "stream": self.stream,
            "length": self.length,
            "lag": self.lag,
            "pending": self.pending,
            "oldest_pending_seconds": round(oldest, 3) if oldest is not None else None,
            "dead_letters": self.dead_letters,
        }


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """One model of the fleet: the live workers serving it, their slots, its queue."""

    model: str
    workers: tuple[str, ...]  # ids of live workers that serve it
    free_slots: int  # summed over those workers
    max_concurrency: int  # summed over those workers
    queue: QueueStatus
    # Fair share by tenant (waiting for a pick, tokens served in 10 minutes); empty when the
    # model's workers never had fair share on.
    tenants: tuple[TenantShare, ...] = ()
    # What its jobs may carry besides text ("image", "video"), as its live workers say.
    media: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "workers": list(self.workers),
            "free_slots": self.free_slots,
            "max_concurrency": self.max_concurrency,
            "media": list(self.media),
            **self.queue.as_dict(),
            "tenants": [share.as_dict() for share in self.tenants],
        }


@dataclass(frozen=True, slots=True)
class DefaultStreamStatus:
    """The default stream (jobs that name no model), and where its jobs go: each live worker
    forwards them to its default model's stream. ``default_models`` counts the live workers
    per default model (more than one key: the workers disagree); ``old_workers`` are live
    workers whose heartbeat advertises no models (an older version, which runs the default
    stream's jobs itself, with its own model)."""

    queue: QueueStatus
    workers: tuple[str, ...]  # every live worker (all of them read the default stream)
    default_models: Mapping[str, int] = field(default_factory=dict)
    old_workers: tuple[str, ...] = ()

    @property
    def disagreement(self) -> bool:
        """Whether live workers forward jobs that name no model to different models."""
        return len(self.default_models) > 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": None,
            "workers": list(self.workers),
            **self.queue.as_dict(),
            "default_models": dict(self.default_models),
            "old_workers": list(self.old_workers),
        }


@dataclass(frozen=True, slots=True)
class Fleet:
    """The catalogue at one moment: one row per model (served or with a stream), by name,
    and the default stream."""

    models: tuple[ModelStatus, ...]
    default: DefaultStreamStatus
    heartbeats: tuple[Heartbeat, ...] = ()

    def model(self, name: str) -> ModelStatus | None:
        return next((status for status in self.models if status.model == name), None)


async def fleet_models(redis: RedisClient, keys: Keys) -> Fleet:
    """Every model that a live worker serves or that is registered with a job stream, each
    with its workers, slots and queue; plus the default stream. Missing streams or groups
    read as empty, never as an error."""
    registered = await read_registry(redis, keys)
    beats = await live_heartbeats(redis, keys, registered)
    # A name that is not a valid model name has no stream (a confused writer): left out.
    served = {model for beat in beats for model in beat.models if is_valid_id(model)}
    names = served | set(registered.models)
    streams = [keys.default_stream, *(keys.model_stream(name) for name in sorted(names))]
    queues = await queue_statuses(redis, streams)
    statuses = []
    for stream, queue in zip(streams[1:], queues[1:], strict=True):
        if stream.model is None:
            continue
        if stream.model not in served and not _exists(queue):
            continue  # registered once, served by nobody now, and no queue: nothing to show
        serving = [beat for beat in beats if beat.serves(stream.model)]
        shares = tuple(await tenant_shares(redis, keys.fair(stream.model)))
        statuses.append(_model_status(stream.model, serving, queue, shares))
    models = tuple(statuses)
    current = [beat for beat in beats if beat.models]
    default = DefaultStreamStatus(
        queue=queues[0],
        workers=tuple(beat.worker_id for beat in beats),
        default_models=dict(sorted(Counter(beat.default_model or "" for beat in current).items())),
        old_workers=tuple(beat.worker_id for beat in beats if not beat.models),
    )
    return Fleet(models=models, default=default, heartbeats=tuple(beats))


def _model_status(
    model: str, serving: list[Heartbeat], queue: QueueStatus, tenants: tuple[TenantShare, ...]
) -> ModelStatus:
    served = [beat.models[model] for beat in serving]
    return ModelStatus(
        model=model,
        workers=tuple(beat.worker_id for beat in serving),
        free_slots=sum(entry.free_slots for entry in served),
        max_concurrency=sum(entry.max_concurrency for entry in served),
        queue=queue,
        tenants=tenants,
        media=tuple(kind for kind in MEDIA_KINDS if any(kind in entry.media for entry in served)),
    )


async def queue_statuses(redis: RedisClient, streams: Sequence[JobStream]) -> list[QueueStatus]:
    """Each stream's length, group lag and pending entries, oldest pending age and dead
    letters: one pipeline (split by node on a Cluster), plus Redis' clock."""
    if not streams:
        return []
    seconds, micros = await redis.time()
    now_ms = seconds * 1000 + micros // 1000
    async with redis.pipeline(transaction=False) as pipe:
        for stream in streams:
            pipe.xlen(stream.stream)
            pipe.xinfo_groups(stream.stream)
            pipe.xpending(stream.stream, stream.group)
            pipe.xlen(stream.dead)
        replies = await pipe.execute(raise_on_error=False)
    for reply in replies:
        if isinstance(reply, ResponseError) and not _is_missing(reply):
            raise reply
    return [
        _queue_status(stream, replies[4 * i : 4 * i + 4], now_ms)
        for i, stream in enumerate(streams)
    ]


def _queue_status(stream: JobStream, replies: Sequence[Any], now_ms: int) -> QueueStatus:
    length, groups, pending, dead = replies
    info = _group_info(groups, stream.group)
    summary = pending if isinstance(pending, dict) else {}
    oldest = summary.get("min") if summary.get("pending") else None
    return QueueStatus(
        stream=stream.stream,
        length=_count(length),
        lag=_optional_count(info.get("lag")) if info else None,
        pending=_count(info.get("pending")) if info else 0,
        oldest_pending_seconds=_age_seconds(oldest, now_ms),
        dead_letters=_count(dead),
        group=bool(info),
    )


def _exists(queue: QueueStatus) -> bool:
    """Whether a queue has anything to show: a stream with a group, entries or dead letters."""
    return queue.group or queue.length > 0 or queue.dead_letters > 0


def _is_missing(error: ResponseError) -> bool:
    """The error of XINFO GROUPS / XPENDING on a stream or group that does not exist, or of
    any read on a key of another type (a stray SET on a stream's name): no queue there."""
    text = str(error)
    return "NOGROUP" in text or "no such key" in text.lower() or "WRONGTYPE" in text


def _group_info(groups: Any, group: str) -> dict[str, Any]:
    """The XINFO GROUPS row of ``group``; empty when the stream (an error reply) or the group
    does not exist."""
    if not isinstance(groups, list):
        return {}
    for row in groups:
        if isinstance(row, dict):
            fields = {as_text(name): value for name, value in row.items()}
            if as_text(fields.get("name", b"")) == group:
                return fields
    return {}


def _age_seconds(entry_id: Any, now_ms: int) -> float | None:
    if entry_id is None:
        return None
    millis = as_text(entry_id).partition("-")[0]
    if not millis.isdigit():
        return None
    return max(now_ms - int(millis), 0) / 1000


def _count(value: Any) -> int:
    counted = _optional_count(value)
    return counted if counted is not None else 0


def _optional_count(value: Any) -> int | None:
    if value is None or isinstance(value, bool | BaseException):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
