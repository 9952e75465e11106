"""Client-side pieces of the reliability drivers: submitting across Redis outages, following a
request across reconnects, and checking a request's replay log entry by entry.

Jobs are queued on the default stream (``keys.jobs``), as a producer that names no model does:
the workers forward each entry to the stream of their model (``MODEL``, the reliability
workers' only model), where it runs, is acknowledged or is dead-lettered.

Imports only ``mlx_redis_protocol`` and redis-py (no MLX), so producer processes start fast.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.codec_events import decode_event
from mlx_redis_protocol.constants import JOB_FIELD, LOG_EVENT_FIELD, LOG_SEQ_FIELD
from mlx_redis_protocol.errors import ClientError, ProtocolError, RequestNotFound, StreamRewritten
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import DeltaEvent, DoneEvent, Event, QueuedEvent, ResetEvent
from mlx_redis_protocol.replay_log import publish_events
from tests.support.events import text_after_last_reset
from tests.support.processes import MODEL

# What a client sees while Redis restarts under it.
CONNECTION_ERRORS = (RedisError, ConnectionError, OSError)


# -- submitting ----------------------------------------------------------------------------


async def submit_raw(
    client: Client, data: bytes, request_id: str | None, *, give_up_after: float = 120.0
) -> int:
    """Queue one job entry (raw bytes, valid or not) with its queued marker; returns how many
    attempts failed on the way.

    A plain retry after an ambiguous failure (the command ran, its reply was lost to a Redis
    restart) would queue the job twice, and two entries of one request would run as two
    attempts 1 at once. So a retry first looks whether the entry is already there: still in
    the default stream, forwarded to the model's stream, dead-lettered, or already started
    (its log grew past the marker).
    """
    keys = client.keys
    failures = 0
    marker_done = request_id is None
    xadd_tried = False
    deadline = time.monotonic() + give_up_after
    while True:
        try:
            if not marker_done:
                assert request_id is not None
                if failures == 0 or not await client.redis.exists(keys.log(request_id)):
                    queued = QueuedEvent(request_id=request_id, seq=0, attempt=0)
                    await publish_events(client.redis, keys, [queued], ttl_seconds=client.log_ttl)
                marker_done = True
            if xadd_tried and await _already_queued(client, data, request_id):
                return failures
            xadd_tried = True
            await client.redis.xadd(keys.jobs, {JOB_FIELD: data})
            return failures
        except CONNECTION_ERRORS:
            failures += 1
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def _already_queued(client: Client, data: bytes, request_id: str | None) -> bool:
    """Looked for in the order an entry moves (default stream, model stream, then dead letters
    or a started log), so one that moves on during the look is still found further along."""
    keys = client.keys
    model = keys.model_stream(MODEL)
    for stream in (keys.jobs, model.stream, model.dead):
        for _entry_id, fields in await client.redis.xrange(stream, "-", "+"):
            if fields.get(JOB_FIELD.encode()) == data:
                return True
    return request_id is not None and await client.redis.xlen(keys.log(request_id)) > 1


# -- following ------------------------------------------------------------------------------


@dataclass
class Followed:
    """What one subscriber saw of a request, merged across its reconnects."""

    request_id: str
    events: list[Event] = field(default_factory=list)
    reconnects: int = 0
    # Events a single subscription yielded twice (the client must never do that).
    duplicates: int = 0
    # Events a resumed subscription replayed and this follower skipped (seq already seen).
    replay_skipped: int = 0
    # Times the stream said the request's history was rewritten and it started over.
    rewrites: int = 0
    error: str | None = None
    ended_at: float | None = None

    @property
    def terminal(self) -> Event | None:
        return self.events[-1] if self.events and self.events[-1].terminal else None

    @property
    def seqs(self) -> list[int]:
        return [event.seq for event in self.events]


async def follow(
    client: Client,
    request_id: str,
    *,
    event_timeout: float = 60.0,
    give_up_after: float = 600.0,
    drop_after: int | None = None,
    pause: float = 0.0,
) -> Followed:
    """Follow a request to its terminal event, resuming after connection losses (and after
    ``drop_after`` events, once, on purpose: a subscriber that leaves for ``pause`` seconds
    and comes back). A resumed stream replays the log from its start; events with a seq
    already seen are skipped, so the merged list must be gapless."""
    result = Followed(request_id)
    last_seq = -1
    deadline = time.monotonic() + give_up_after
    dropped = False
    while True:
        seen_here: set[int] = set()
        try:
            async with aclosing(client.stream(request_id, timeout=event_timeout)) as events:
                async for event in events:
                    if event.seq in seen_here:
                        result.duplicates += 1
                        continue
                    seen_here.add(event.seq)
                    if event.seq <= last_seq:
                        result.replay_skipped += 1
                        continue
                    result.events.append(event)
                    last_seq = event.seq
                    if event.terminal:
                        result.ended_at = time.time()
                        return result
                    if drop_after is not None and not dropped and len(result.events) >= drop_after:
                        dropped = True
                        break
            if dropped and result.reconnects == 0:
                result.reconnects += 1
                await asyncio.sleep(pause)
                continue
            result.error = "stream ended without a terminal event"
            return result
        except RequestNotFound as exc:
            result.error = f"not found: {exc}"
            return result
        except StreamRewritten:
            # Redis lost events this subscriber had (a failover): what it saw is void, the
            # log is whole again; follow it afresh, as a client is told to.
            result.rewrites += 1
            result.events.clear()
            last_seq = -1
        except (*CONNECTION_ERRORS, ClientError, TimeoutError) as exc:
            result.reconnects += 1
            if time.monotonic() > deadline:
                result.error = f"gave up: {type(exc).__name__}: {exc}"
                return result
            await asyncio.sleep(0.2)


# -- the replay log, entry by entry --------------------------------------------------------


@dataclass
class LogCheck:
    """A request's replay log read with XRANGE and checked against the event rules."""

    request_id: str
    events: list[Event]
    problems: list[str]
    terminals: int
    repeated_seqs: int
    resets: int
    attempts: list[int]
    final_text: str

    @property
    def terminal(self) -> Event | None:
        found = [e for e in self.events if e.terminal]
        return found[-1] if found else None

    @property
    def seqs(self) -> list[int]:
        return [e.seq for e in self.events]


def read_log_entries(
    redis: Any, keys: Keys, request_id: str
) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """XRANGE of the request's log with a sync ``decode_responses=False`` client."""
    return list(redis.xrange(keys.log(request_id), "-", "+"))


def check_log(
    request_id: str, entries: Sequence[tuple[bytes, dict[bytes, bytes]]], *, queued: bool = True
) -> LogCheck:
    """Every rule a finished request's log must hold: the queued marker (seq 0) once and
    first (when the producer wrote one); then seqs 1..n, each once; the log field ``seq``
    agrees with the event; exactly one terminal event and nothing after it;
    attempts never go down; a ``reset`` exactly where a new attempt (> 1) starts, nowhere
    else; the deltas after the last reset spell the ``done`` event's output_text."""
    problems: list[str] = []
    events: list[Event] = []
    for stream_id, fields in entries:
        try:
            event = decode_event(fields.get(LOG_EVENT_FIELD.encode()))
        except ProtocolError as exc:
            problems.append(f"undecodable log entry {stream_id!r}: {exc}")
            continue
        if event.request_id != request_id:
            problems.append(f"event of {event.request_id!r} in the log")
        if fields.get(LOG_SEQ_FIELD.encode()) != str(event.seq).encode():
            problems.append(f"log field seq {fields.get(b'seq')!r} != event seq {event.seq}")
        attempt_field = fields.get(b"a")  # older logs carry the attempt as a field too
        if attempt_field is not None and attempt_field != str(event.attempt).encode():
            problems.append(f"log field a {fields.get(b'a')!r} != event attempt {event.attempt}")
        events.append(event)
    body = events
    if queued:
        markers = [e for e in events if isinstance(e, QueuedEvent)]
        if len(markers) != 1 or not events or not isinstance(events[0], QueuedEvent):
            problems.append(f"{len(markers)} queued markers, first is {events[:1]}")
        body = [e for e in events if not isinstance(e, QueuedEvent)]
    seqs = [e.seq for e in body]
    repeated = len(seqs) - len(set(seqs))
    if seqs != list(range(1, len(body) + 1)):
        problems.append(f"seqs are not 1..{len(body)}: {_short(seqs)}")
    terminal_events = [e for e in body if e.terminal]
    if len(terminal_events) != 1:
        problems.append(f"{len(terminal_events)} terminal events")
    elif body[-1] is not terminal_events[0]:
        problems.append("events after the terminal event")
    attempts = [e.attempt for e in body]
    if attempts != sorted(attempts):
        problems.append(f"attempts go down: {_short(attempts)}")
    previous_attempt = 0 if queued else 1
    resets = 0
    final_text = ""
    for event in body:
        changed = event.attempt != previous_attempt
        if isinstance(event, ResetEvent):
            resets += 1
            final_text = ""
            if not changed or event.attempt < 2:
                problems.append(f"reset at seq {event.seq} without a new attempt")
        elif changed and event.attempt > 1:
            problems.append(f"attempt {event.attempt} starts at seq {event.seq} without a reset")
        elif isinstance(event, DeltaEvent):
            final_text += event.new_text
        previous_attempt = event.attempt
    last = terminal_events[-1] if terminal_events else None
    if isinstance(last, DoneEvent) and final_text != last.output_text:
        problems.append("the deltas after the last reset differ from output_text")
    return LogCheck(
        request_id=request_id,
        events=events,
        problems=problems,
        terminals=len(terminal_events),
        repeated_seqs=repeated,
        resets=resets,
        attempts=sorted(set(attempts)),
        final_text=final_text,
    )


def check_followed(followed: Followed, log: LogCheck) -> list[str]:
    """A subscriber's merged stream: gapless from the marker, no duplicate, the same events
    as the log, ending with the terminal event; its text after the last reset is the log's."""
    problems = []
    if followed.error is not None:
        problems.append(f"subscriber: {followed.error}")
    if followed.duplicates:
        problems.append(f"subscriber got {followed.duplicates} duplicate events")
    seqs = followed.seqs
    if seqs != list(range(len(seqs))):
        problems.append(f"subscriber seqs not gapless from 0: {_short(seqs)}")
    if seqs != log.seqs:
        problems.append(f"subscriber seqs {_short(seqs)} != log seqs {_short(log.seqs)}")
    if followed.terminal is None:
        problems.append("subscriber saw no terminal event")
    if text_after_last_reset(followed.events) != log.final_text:
        problems.append("subscriber text after the last reset differs from the log's")
    return problems


def settled_now(admin: Any, keys: Keys, model: str = MODEL) -> bool:
    """Everything forwarded (the default stream empty, nothing pending on it), and the
    model's stream empty with nothing pending (a worker acknowledges and deletes an entry
    just after its terminal event)."""
    stream = keys.model_stream(model)
    return all(
        admin.xlen(name) == 0 and admin.xpending(name, group)["pending"] == 0
        for name, group in ((keys.jobs, keys.group), (stream.stream, stream.group))
    )


def wait_settled(admin: Any, keys: Keys, timeout: float = 60.0, model: str = MODEL) -> bool:
    """``settled_now``, waited for; False after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with suppress(*CONNECTION_ERRORS):
            if settled_now(admin, keys, model):
                return True
        time.sleep(0.2)
    return False


def dead_letters(redis: Any, keys: Keys, model: str = MODEL) -> list[dict[str, bytes]]:
    """Every entry of the model stream's dead letters (field names decoded, values as bytes):
    jobs queued on the default stream are forwarded there first, and dead-lettered there."""
    rows: list[dict[str, bytes]] = []
    start: bytes | str = "-"
    while batch := redis.xrange(keys.model_stream(model).dead, start, "+", count=1000):
        rows += [{k.decode(): v for k, v in fields.items()} for _, fields in batch]
        start = b"(" + batch[-1][0]
    return rows


def stray_dead_letters(redis: Any, keys: Keys) -> list[str]:
    """Problems if the default stream has dead letters: every entry is forwarded from there
    (garbage included), so jobs are dead-lettered on a model's stream, never on the default
    stream's."""
    count = int(redis.xlen(keys.dead))
    return [f"{count} dead letters on the default stream ({keys.dead})"] if count else []


def _short(values: Sequence[int]) -> str:
    if len(values) <= 24:
        return str(list(values))
    return f"{list(values[:10])}...{list(values[-10:])} ({len(values)})"
