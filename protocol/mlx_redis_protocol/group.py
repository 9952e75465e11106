"""The job streams' consumer groups seen by an operator: their consumers, and removing stopped
ones.

Redis keeps a consumer in the group until someone deletes it, so every worker id that ever
read a job stays listed (``XINFO CONSUMERS``, ``stats``) long after its worker is gone. Deleting
one is safe only while it holds no pending entries: ``XGROUP DELCONSUMER`` drops a consumer's
pending entries with it, and an entry no longer pending is never reclaimed (``XAUTOCLAIM``
only sees pending ones): its job would sit in the stream unserved for good. So the check and
the delete are one script, used by a worker leaving the group at a clean stop and by
``mlx-worker group prune`` alike. Every job stream has its group (the default stream and each
model's, see protocol/mlx_redis_protocol/catalogue.py), and a worker is a consumer in each group it
reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from redis.exceptions import ResponseError

from mlx_redis_protocol.catalogue import job_streams
from mlx_redis_protocol.connection import RedisClient, as_text, exists_each
from mlx_redis_protocol.identifiers import is_valid_id
from mlx_redis_protocol.keys import JobStream, Keys
from mlx_redis_protocol.lua import run_script

# KEYS[1] the job stream; ARGV[1] the group, ARGV[2] the consumer. Deletes the consumer unless
# it holds pending entries, atomically: between a separate check and the delete, the consumer
# could read a job that the delete would then drop from the pending list. 1: deleted (or it
# was not there), 0: kept, it holds pending entries.
REMOVE_IDLE_CONSUMER: Final = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then
  return 0
end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# `group prune` leaves consumers idle for less than this alone by default: a worker that is
# alive reads every second, so an hour without a read means it is gone (or stuck).
DEFAULT_PRUNE_IDLE_SECONDS: Final = 3600.0


class NoGroup(ValueError):
    """The job stream or its consumer group does not exist (no worker ever started with this
    prefix, or Redis lost its data)."""


@dataclass(frozen=True, slots=True)
class Consumer:
    """One consumer of the job group, as ``XINFO CONSUMERS`` and its heartbeat key show it."""

    name: str
    pending: int  # entries delivered to it and not acknowledged
    idle_seconds: float  # since its last read or claim
    heartbeat: bool  # whether a worker of that id is alive (its heartbeat key exists)
    raw_name: bytes = field(default=b"", repr=False, compare=False)
    # The job stream whose group it is in (None only for a Consumer built by hand).
    stream: JobStream | None = field(default=None, repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pending": self.pending,
            "idle_seconds": round(self.idle_seconds, 3),
            "heartbeat": self.heartbeat,
            "stream": self.stream.stream if self.stream is not None else None,
            "model": self.stream.model if self.stream is not None else None,
        }


@dataclass(frozen=True, slots=True)
class Pruned:
    """What ``prune`` did with one consumer it chose."""

    consumer: Consumer
    removed: bool  # False: a dry run, or it took a job between the listing and the removal


async def remove_idle_consumer(
    redis: RedisClient, stream: JobStream, consumer: str | bytes
) -> bool:
    """Delete ``consumer`` from the stream's group unless it holds pending entries (one atomic
    step); True when it is gone."""
    removed = await run_script(
        redis, REMOVE_IDLE_CONSUMER, [stream.stream], [stream.group, consumer]
    )
    return bool(removed)


async def list_consumers(
    redis: RedisClient, keys: Keys, stream: JobStream | None = None
) -> list[Consumer]:
    """The group's consumers on ``stream`` (default: the default stream), each with its
    heartbeat looked up; NoGroup when there is none."""
    stream = stream or keys.default_stream
    try:
        rows: Any = await redis.xinfo_consumers(stream.stream, stream.group)
    except ResponseError as exc:
        if "NOGROUP" in str(exc) or "no such key" in str(exc).lower():
            raise NoGroup(
                f"no consumer group {stream.group!r} on {stream.stream} (has a worker with "
                f"prefix {keys.prefix!r} ever started?)"
            ) from exc
        raise
    infos = [{as_text(k): v for k, v in row.items()} for row in rows]
    names = [_raw(info.get("name", b"")) for info in infos]
    alive = await _heartbeats(redis, keys, names)
    return [
        Consumer(
            name=raw.decode(errors="replace"),
            pending=int(info.get("pending", 0)),
            idle_seconds=int(info.get("idle", 0)) / 1000,
            heartbeat=beating,
            raw_name=raw,
            stream=stream,
        )
        for raw, info, beating in zip(names, infos, alive, strict=True)
    ]


async def list_all_consumers(
    redis: RedisClient, keys: Keys, streams: list[JobStream] | None = None
) -> list[Consumer]:
    """The consumers of every job stream's group (``streams``, default: the default stream
    and every model's stream found by SCAN), stream by stream; streams without a group are
    skipped. NoGroup (the default stream's) when none of them has a group."""
    if streams is None:
        streams = await job_streams(redis, keys)
    consumers: list[Consumer] = []
    missing: NoGroup | None = None
    found = False
    for stream in streams:
        try:
            consumers += await list_consumers(redis, keys, stream)
        except NoGroup as exc:
            missing = missing or exc
            continue
        found = True
    if not found and missing is not None:
        raise missing
    return consumers


async def prune(
    redis: RedisClient,
    keys: Keys,
    idle_seconds: float = DEFAULT_PRUNE_IDLE_SECONDS,
    *,
    dry_run: bool = False,
    streams: list[JobStream] | None = None,
) -> list[Pruned]:
    """Remove the consumers with no pending entries, idle for ``idle_seconds`` or more and
    without a live heartbeat. A consumer holding pending entries is never removed: its jobs
    wait for a restart under its id, or for another worker to reclaim them after the lease.
    Covers every job stream's group (``streams``, default: all of them, as
    ``list_all_consumers``); a worker is one consumer per group, each judged on its own."""
    if idle_seconds < 0:
        raise ValueError(f"the idle time must be >= 0 seconds, got {idle_seconds:g}")
    chosen = [
        consumer
        for consumer in await list_all_consumers(redis, keys, streams)
        if consumer.pending == 0
        and consumer.idle_seconds >= idle_seconds
        and not consumer.heartbeat
    ]
    if dry_run:
        return [Pruned(consumer, removed=False) for consumer in chosen]
    return [
        Pruned(
            consumer,
            removed=await remove_idle_consumer(
                redis, consumer.stream or keys.default_stream, consumer.raw_name
            ),
        )
        for consumer in chosen
    ]


async def _heartbeats(redis: RedisClient, keys: Keys, names: list[bytes]) -> list[bool]:
    """Whether each consumer's heartbeat key exists, in one round trip (one per node on a
    Cluster). A name that is not a valid worker id has no heartbeat key: not alive."""
    checked = [(i, keys.worker(name.decode())) for i, name in enumerate(names) if _is_id(name)]
    found = [False] * len(names)
    alive = await exists_each(redis, [key for _, key in checked])
    for (index, _), beating in zip(checked, alive, strict=True):
        found[index] = beating
    return found


def _is_id(name: bytes) -> bool:
    try:
        return is_valid_id(name.decode())
    except UnicodeDecodeError:
        return False


def _raw(value: object) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()
