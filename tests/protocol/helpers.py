"""Event builders and a scripted stand-in for a worker, writing events the way one would."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable
from typing import Any

from redis.asyncio import Redis

from mlx_redis_protocol.codec_events import encode_event
from mlx_redis_protocol.constants import JOB_FIELD, LOG_EVENT_FIELD, LOG_SEQ_FIELD
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import (
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    Event,
    QueuedEvent,
    ResetEvent,
    Usage,
)
from mlx_redis_protocol.replay_log import Outcome, begin_attempt, publish_events


def delta(request_id: str, seq: int, text: str, attempt: int = 1) -> DeltaEvent:
    return DeltaEvent(
        request_id=request_id,
        seq=seq,
        attempt=attempt,
        new_text=text,
        new_token_ids=tuple(range(seq * 10, seq * 10 + len(text))),
    )


def done(request_id: str, seq: int, text: str, reason: Any = "stop", attempt: int = 1) -> DoneEvent:
    return DoneEvent(
        request_id=request_id,
        seq=seq,
        attempt=attempt,
        finish_reason=reason,
        output_text=text,
        usage=Usage(prompt_tokens=3, completion_tokens=len(text), ttft_ms=1.5),
    )


def error(request_id: str, seq: int, code: str = "engine_error", attempt: int = 1) -> ErrorEvent:
    return ErrorEvent(
        request_id=request_id, seq=seq, attempt=attempt, code=code, message="it broke"
    )


def reset(request_id: str, seq: int, attempt: int) -> ResetEvent:
    return ResetEvent(request_id=request_id, seq=seq, attempt=attempt)


def queued(request_id: str) -> QueuedEvent:
    return QueuedEvent(request_id=request_id, seq=0, attempt=0)


def text_events(request_id: str, pieces: Iterable[str], reason: Any = "stop") -> list[Event]:
    """Deltas for each piece, then done with the joined text."""
    pieces = list(pieces)
    events: list[Event] = [delta(request_id, i + 1, piece) for i, piece in enumerate(pieces)]
    events.append(done(request_id, len(pieces) + 1, "".join(pieces), reason))
    return events


def run_of(attempt: int) -> str:
    """The run token these tests begin ``attempt`` with."""
    return f"test-attempt-{attempt}"


async def begin(redis: Redis, keys: Keys, request_id: str, attempt: int = 1) -> int:
    """BEGIN_ATTEMPT as a worker runs it, with the attempt's test run."""
    return await begin_attempt(redis, keys, request_id, attempt, 600, run_of(attempt))


async def emit(redis: Redis, keys: Keys, *events: Event) -> list[Outcome]:
    """Publish and log exactly as workers do: each attempt begun (BEGIN_ATTEMPT) before its
    events are sent with its run token, one attempt after the other."""
    outcomes: list[Outcome] = []
    for (request_id, attempt), group in itertools.groupby(
        events, key=lambda event: (event.request_id, event.attempt)
    ):
        if attempt:
            await begin(redis, keys, request_id, attempt)
        batch = list(group)
        outcomes += await publish_events(redis, keys, batch, runs={request_id: run_of(attempt)})
    return outcomes


async def append_only(redis: Redis, keys: Keys, event: Event) -> None:
    """Log an event without publishing it (a publish lost on the way)."""
    fields = {LOG_SEQ_FIELD: event.seq, LOG_EVENT_FIELD: encode_event(event)}
    await redis.xadd(keys.log(event.request_id), fields)  # type: ignore[arg-type]


async def publish_only(redis: Redis, keys: Keys, event: Event) -> None:
    """Publish an event without logging it (a repeated or reordered delivery)."""
    await redis.publish(keys.out(event.request_id), encode_event(event))


async def wait_for_job(redis: Redis, keys: Keys, timeout: float = 5.0) -> bytes:
    """The first job entry's encoded job, as a worker would read it."""
    deadline = asyncio.get_running_loop().time() + timeout
    # Blocks of 1 s: redis-py's default socket timeout (5 s) would cut a longer XREAD short.
    while not (entries := await redis.xread({keys.jobs: "0"}, count=1, block=1000)):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("no job arrived")
    _stream, messages = entries[0]
    _entry_id, fields = messages[0]
    data: bytes = fields[JOB_FIELD.encode()]
    return data
