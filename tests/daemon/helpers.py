"""Streams of the daemon integration tests: collecting one, the invariants every finished one
holds, and what is left in the job group; ``mlx-worker health``."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Sequence
from contextlib import aclosing

from redis.exceptions import RedisError

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.connection import as_text
from mlx_redis_protocol.messages import (
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    Event,
    QueuedEvent,
    ResetEvent,
)
from tests.support.events import text_after_last_reset
from tests.support.processes import MODEL, mlx_worker


def health(worker_id: str, redis_url: str, prefix: str) -> int:
    """Exit status of ``mlx-worker health``."""
    completed = mlx_worker(
        "health", "--worker-id", worker_id, "--redis-url", redis_url, "--prefix", prefix, timeout=60
    )
    return completed.returncode


# -- streams --------------------------------------------------------------------------------


async def collect(client: Client, request_id: str, timeout: float = 60.0) -> list[Event]:
    """Every event of a request, in the order the client yields them, up to the terminal."""
    async with aclosing(client.stream(request_id, timeout=timeout)) as events:
        return [event async for event in events]


async def collect_surviving_restarts(
    client: Client, request_id: str, timeout: float = 60.0, give_up_after: float = 90.0
) -> tuple[list[Event], int]:
    """``collect`` that starts over after a connection error (Redis restarted under it).

    Starting over is enough: a stream merges the replay log from its beginning. Returns the
    events of the stream that completed and how many attempts failed on the way.
    """
    failures = 0
    deadline = time.monotonic() + give_up_after
    while True:
        try:
            return await collect(client, request_id, timeout), failures
        except (RedisError, ConnectionError, OSError) as exc:
            failures += 1
            if time.monotonic() > deadline:
                raise AssertionError(f"stream of {request_id} kept failing: {exc!r}") from exc
            await asyncio.sleep(0.2)


@dataclasses.dataclass
class StreamSummary:
    terminal: DoneEvent | ErrorEvent
    final_text: str  # the deltas after the last reset, concatenated
    resets: list[ResetEvent]
    deltas: list[DeltaEvent]
    attempts: list[int]


def check_stream(events: Sequence[Event], request_id: str) -> StreamSummary:
    """The invariants every finished stream must hold; returns what the tests look at.

    The queued marker has seq 0, then seqs 1..n without a gap or repeat (across attempts),
    exactly one terminal event and it is the last one, attempts never go down and a reset
    starts each new attempt.
    """
    assert events, f"{request_id}: no events"
    assert all(e.request_id == request_id for e in events)
    body = list(events)
    if isinstance(body[0], QueuedEvent):
        assert body[0].seq == 0
        body = body[1:]
    seqs = [e.seq for e in body]
    assert seqs == list(range(1, len(body) + 1)), f"{request_id}: seqs not gapless: {seqs}"
    terminals = [e for e in body if e.terminal]
    assert len(terminals) == 1, f"{request_id}: {len(terminals)} terminal events"
    assert body[-1] is terminals[0], f"{request_id}: events after the terminal one"
    terminal = terminals[0]
    assert isinstance(terminal, DoneEvent | ErrorEvent)
    attempts = [e.attempt for e in body]
    assert attempts == sorted(attempts), f"{request_id}: attempts go down: {attempts}"
    resets = [e for e in body if isinstance(e, ResetEvent)]
    for previous, event in itertools.pairwise(body):
        if event.attempt != previous.attempt:
            assert isinstance(event, ResetEvent), (
                f"{request_id}: attempt {event.attempt} starts without a reset: {event}"
            )
    final_text = text_after_last_reset(body)
    if isinstance(terminal, DoneEvent):
        assert final_text == terminal.output_text, f"{request_id}: deltas != output_text"
    return StreamSummary(
        terminal=terminal,
        final_text=final_text,
        resets=resets,
        deltas=[e for e in body if isinstance(e, DeltaEvent)],
        attempts=sorted(set(attempts)),
    )


async def log_length(client: Client, request_id: str) -> int:
    """Entries in the request's replay log (the queued marker included)."""
    return int(await client.redis.xlen(client.keys.log(request_id)))


async def pending_ids(client: Client, model: str = MODEL) -> dict[str, str]:
    """Pending entries of the model's job stream: entry id -> consumer."""
    stream = client.keys.model_stream(model)
    rows = await client.redis.xpending_range(
        stream.stream, stream.group, min="-", max="+", count=1000
    )
    return {as_text(row["message_id"]): as_text(row["consumer"]) for row in rows}


async def settled(client: Client, model: str = MODEL) -> bool:
    """Every job entry forwarded from the default stream, acknowledged (nothing pending) and
    deleted from the model's stream.

    A worker acknowledges after the terminal event is written, so a client can see ``done``
    a moment before this turns true: wait for it with ``until``.
    """
    keys = client.keys
    return (
        not await pending_ids(client, model)
        and await client.redis.xlen(keys.model_stream(model).stream) == 0
        and await client.redis.xlen(keys.jobs) == 0
    )
