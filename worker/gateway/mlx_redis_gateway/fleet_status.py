"""What the status page shows, read from Redis in a few round trips: the fleet's catalogue
(workers, models, slots, queues), each worker's activity (running requests with their token
counts, tokens per time bucket) and the newest dead letters with their reasons."""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Final

from mlx_redis_protocol.activity import Activity, RequestActivity, decode_activity
from mlx_redis_protocol.catalogue import Fleet, fleet_models
from mlx_redis_protocol.connection import RedisClient
from mlx_redis_protocol.identifiers import stream_id_time
from mlx_redis_protocol.keys import Keys

# Dead letters read per dead-letter stream, and shown in all.
DEAD_LETTERS_SHOWN: Final = 20
# A dead letter's time past this (year 9999) is shown as unknown: no date can show it.
LATEST_TIME: Final = 253_402_300_799.0
# How many times a dead letter was delivered: ASCII digits (str.isdigit takes "²"), at most 9.
_DIGITS: Final = re.compile(r"[0-9]{1,9}")


@dataclass(frozen=True, slots=True)
class DeadLetter:
    stream: str
    entry_id: str
    at: float | None  # when it was dead-lettered (epoch seconds, from its id)
    request_id: str | None
    code: str
    message: str
    deliveries: int | None


@dataclass(frozen=True, slots=True)
class RunningRequest:
    worker_id: str
    activity: RequestActivity


@dataclass(frozen=True, slots=True)
class FleetStatus:
    at: float  # when it was read (epoch seconds, this host)
    fleet: Fleet
    running: tuple[RunningRequest, ...]
    # Tokens per second of the whole fleet, one point per bucket (start, rate), oldest first,
    # over the last ``window_seconds``, empty buckets included as zero.
    throughput: tuple[tuple[int, float], ...]
    bucket_seconds: int
    dead_letters: tuple[DeadLetter, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "workers": [
                {
                    "worker_id": beat.worker_id,
                    "pid": beat.pid,
                    "started_at": beat.started_at,
                    "in_flight": beat.in_flight,
                    "default_model": beat.default_model,
                    "version": beat.version,
                    "models": {
                        name: {
                            "max_concurrency": m.max_concurrency,
                            "free_slots": m.free_slots,
                            "in_flight": m.in_flight,
                            "media": list(m.media),
                        }
                        for name, m in beat.models.items()
                    },
                }
                for beat in self.fleet.heartbeats
            ],
            "models": [model.as_dict() for model in self.fleet.models],
            "default_stream": self.fleet.default.as_dict(),
            "running": [
                {
                    "worker_id": item.worker_id,
                    "request_id": item.activity.request_id,
                    "model": item.activity.model,
                    "attempt": item.activity.attempt,
                    "tokens": item.activity.tokens,
                    "started_at": item.activity.started_at,
                }
                for item in self.running
            ],
            "throughput": {
                "bucket_seconds": self.bucket_seconds,
                "points": [[start, round(rate, 2)] for start, rate in self.throughput],
            },
            "dead_letters": [
                {
                    "stream": dead.stream,
                    "entry_id": dead.entry_id,
                    "at": dead.at,
                    "request_id": dead.request_id,
                    "code": dead.code,
                    "message": dead.message,
                    "deliveries": dead.deliveries,
                }
                for dead in self.dead_letters
            ],
        }


async def read_fleet_status(
    redis: RedisClient, keys: Keys, *, window_seconds: int = 300
) -> FleetStatus:
    fleet = await fleet_models(redis, keys)
    activities = await _activities(redis, keys, [beat.worker_id for beat in fleet.heartbeats])
    running = tuple(
        RunningRequest(activity.worker_id, request)
        for activity in activities
        for request in sorted(activity.requests, key=lambda r: r.started_at)
    )
    bucket = min((a.bucket_seconds for a in activities), default=2)
    now = time.time()
    dead_names = [
        keys.default_stream.dead,
        *(keys.model_stream(m.model).dead for m in fleet.models),
    ]
    return FleetStatus(
        at=now,
        fleet=fleet,
        running=running,
        throughput=_throughput(activities, bucket, now, window_seconds),
        bucket_seconds=bucket,
        dead_letters=await _dead_letters(redis, dead_names),
    )


async def _activities(redis: RedisClient, keys: Keys, worker_ids: list[str]) -> list[Activity]:
    if not worker_ids:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for worker_id in worker_ids:
            pipe.get(keys.activity(worker_id))
        values = await pipe.execute(raise_on_error=False)  # a key of another type: skipped
    decoded = [decode_activity(value) for value in values if isinstance(value, bytes | str)]
    return [activity for activity in decoded if activity is not None]


def _throughput(
    activities: list[Activity], bucket: int, now: float, window_seconds: int
) -> tuple[tuple[int, float], ...]:
    """The fleet's tokens per second per bucket of the window; the current bucket (still
    filling) is left out, so the plot's last point is not a false dip."""
    tokens: dict[int, int] = defaultdict(int)
    for activity in activities:
        for start, count in activity.buckets:
            # Workers with a coarser bucket land in the bucket their start falls in.
            tokens[start - start % bucket] += count
    current = int(now // bucket) * bucket
    starts = range(current - window_seconds, current, bucket)
    return tuple((start, tokens.get(start, 0) / bucket) for start in starts)


async def _dead_letters(redis: RedisClient, streams: list[str]) -> tuple[DeadLetter, ...]:
    async with redis.pipeline(transaction=False) as pipe:
        for stream in streams:
            pipe.xrevrange(stream, count=DEAD_LETTERS_SHOWN)
        replies = await pipe.execute(raise_on_error=False)
    letters: list[DeadLetter] = []
    for stream, entries in zip(streams, replies, strict=True):
        if not isinstance(entries, list):
            continue
        for entry_id, raw in entries:
            fields = {_text(name): value for name, value in raw.items()}
            letters.append(_dead_letter(stream, _text(entry_id), fields))
    letters.sort(key=lambda dead: dead.at or 0.0, reverse=True)
    return tuple(letters[:DEAD_LETTERS_SHOWN])


def _dead_letter(stream: str, entry_id: str, fields: dict[str, Any]) -> DeadLetter:
    def text(name: str) -> str | None:
        value = fields.get(name)
        return _text(value) if value is not None else None

    deliveries = text("deliveries")
    at = stream_id_time(entry_id)
    return DeadLetter(
        stream=stream,
        entry_id=entry_id,
        # An id a writer chose (XADD with an explicit id) can lie past any date.
        at=at if at is not None and 0 < at < LATEST_TIME else None,
        request_id=text("request_id"),
        code=text("code") or "unknown",
        message=text("message") or "",
        deliveries=int(deliveries) if deliveries and _DIGITS.fullmatch(deliveries) else None,
    )


def _text(value: object) -> str:
    """Anything a producer wrote, as text a page can show: bytes that are not UTF-8 are
    replaced, never an error."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value).encode("utf-8", "replace").decode("utf-8")
