"""Following one request's events: the live channel merged with the replay log.

Subscribe first, then read the log from the start: anything published before the
subscription is in the log, anything after arrives live (and is in the log too, since every
event is appended and published atomically). Live events that skip a seq mean something was
missed, so the log is read again from where it was last read. While idle, the log is
re-read every ``recheck_interval`` seconds in case a publish was lost (e.g. across a
reconnect); that wait blocks on the inbox, it never spins.

Redis being unreachable does not end a stream: the follower subscribes again and re-reads the
log from where it was (the ordering state survives, so nothing is released twice), backing off
between tries; on a Cluster it reads the slot map again first, so a failover is followed to
the master that serves the request's slot now. It gives up when the stream's own timeout
passes without an event (StreamTimeout) or Redis stays unreachable for ``unavailable_timeout``
(RedisUnavailable).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator

from mlx_redis_protocol.channels import MISSED, SUBSCRIBE_CONFIRM_TIMEOUT, ChannelHub, Inbox
from mlx_redis_protocol.codec_events import decode_event
from mlx_redis_protocol.connection import (
    RECONNECT_BACKOFF,
    RedisClient,
    is_unavailable,
    raise_if_cancelled,
    refresh_slot_map,
)
from mlx_redis_protocol.errors import (
    ProtocolError,
    RedisUnavailable,
    RequestExpired,
    RequestLost,
    RequestNotFound,
    StreamTimeout,
)
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.limits import Limits
from mlx_redis_protocol.messages import Event
from mlx_redis_protocol.ordering import EventOrdering
from mlx_redis_protocol.replay_log import read_log_and_ttl

# Redis never expires a key early, but the follower's clock started before the PTTL reply: a
# log gone this long before its TTL's end was lost, not expired.
EXPIRY_MARGIN_SECONDS = 1.0


async def follow_events(
    redis: RedisClient,
    hub: ChannelHub,
    keys: Keys,
    request_id: str,
    *,
    limits: Limits,
    timeout: float | None,
    recheck_interval: float,
    unavailable_timeout: float,
    commands: asyncio.Semaphore | None = None,
) -> AsyncGenerator[Event, None]:
    """Yield the request's events in seq order until the terminal one (done or error).

    ``timeout``: most seconds to wait for the next event (None: no limit) before raising
    StreamTimeout. Raises RequestNotFound when there is no log (RequestExpired when the
    request finished and its log expired), RequestExpired when the log expires while waiting,
    and RequestLost when it vanishes before its TTL could have run out (Redis lost its data).
    ``commands`` bounds how many Redis commands the caller's followers send at once.
    """
    follower = _Follower(redis, keys, request_id, limits, commands)
    last_event_at = time.monotonic()
    failures = 0
    unavailable_since: float | None = None
    # The retry loop is written out, not redis-py's Retry.call_with_retry: what is retried
    # yields events to the caller (a generator cannot run inside a callback), and each wait is
    # cut short by the stream's own timeout.
    while True:
        confirm_timeout = SUBSCRIBE_CONFIRM_TIMEOUT
        if timeout is not None:  # the wait for the subscription counts against the stream's
            confirm_timeout = min(confirm_timeout, timeout - (time.monotonic() - last_event_at))
        try:
            async with hub.listen(keys.out(request_id), confirm_timeout=confirm_timeout) as inbox:
                released = await follower.read_log()
                if follower.log_cursor is None:
                    raise await follower.not_found()
                failures, unavailable_since = 0, None
                while True:
                    raise_if_cancelled()
                    for event in released:
                        yield event
                    if follower.ordering.finished:
                        return
                    now = time.monotonic()
                    if released:
                        last_event_at = now
                    if timeout is not None and now - last_event_at >= timeout:
                        raise StreamTimeout(f"request {request_id!r}: no event for {timeout:g} s")
                    wait = recheck_interval - (now - follower.in_order_at)
                    if timeout is not None:
                        wait = min(wait, timeout - (now - last_event_at))
                    released = await follower.next_live(inbox, max(wait, 0.0))
                    if not released and time.monotonic() - follower.in_order_at >= recheck_interval:
                        released = await follower.recheck_log()
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            now = time.monotonic()
            unavailable_since = unavailable_since or now
            if timeout is not None and now - last_event_at >= timeout:
                raise StreamTimeout(
                    f"request {request_id!r}: no event for {timeout:g} s "
                    f"(Redis unreachable: {type(exc).__name__})"
                ) from exc
            if now - unavailable_since >= unavailable_timeout:
                raise RedisUnavailable(
                    f"Redis unreachable for {unavailable_timeout:g} s while following "
                    f"{request_id!r}: {exc}"
                ) from exc
            failures += 1
            await refresh_slot_map(redis)
            delay = RECONNECT_BACKOFF.compute(failures)
            if timeout is not None:
                delay = min(delay, max(timeout - (now - last_event_at), 0.0))
            await asyncio.sleep(delay)


class _Follower:
    """The merge state of one subscription: where the log was read to, and the ordering."""

    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        request_id: str,
        limits: Limits,
        commands: asyncio.Semaphore | None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.request_id = request_id
        self.limits = limits
        self.commands = commands
        self.ordering = EventOrdering()
        self.log_cursor: bytes | None = None
        # When the follower last knew it had every event up to the newest it had heard of: a
        # log read, or a live event that left no gap. The idle re-read counts from here.
        self.in_order_at = time.monotonic()
        # The earliest the log can expire (monotonic clock; inf: it has no TTL), as of the
        # last read that found it; None before one did.
        self.log_expires_at: float | None = None

    async def read_log(self) -> list[Event]:
        """Offer every log entry after the cursor; returns what that released."""
        async with self._command():
            asked_at = time.monotonic()
            entries, ttl_ms = await read_log_and_ttl(
                self.redis, self.keys, self.request_id, after=self.log_cursor
            )
        self.in_order_at = time.monotonic()
        if ttl_ms >= 0:
            self.log_expires_at = asked_at + ttl_ms / 1000
        elif ttl_ms == -1:
            self.log_expires_at = float("inf")
        released: list[Event] = []
        for entry in entries:
            self.log_cursor = entry.stream_id
            if entry.seq >= 0:
                released += self.ordering.offer(self._decode(entry.data), hash(entry.data))
        return released

    async def recheck_log(self) -> list[Event]:
        """An idle re-read; a log that has vanished meanwhile expired, or was lost."""
        released = await self.read_log()
        if not released:
            async with self._command():
                exists = await self.redis.exists(self.keys.log(self.request_id))
            if not exists:
                raise self.vanished()
        return released

    def vanished(self) -> RequestNotFound:
        """The error for a log this follower read that is gone now: lost when its TTL cannot
        have run out yet, expired otherwise."""
        expires_at = self.log_expires_at
        early = None if expires_at is None else expires_at - time.monotonic()
        if early is not None and early > EXPIRY_MARGIN_SECONDS:
            before = "" if early == float("inf") else f" {early:.0f} s before its TTL ran out"
            return RequestLost(
                self.request_id,
                f"its log vanished{before} while following it: Redis lost the data "
                "(restarted empty, flushed, evicted, or failed over to a replica without it), "
                "or someone deleted it; queue the job again",
            )
        return RequestExpired(self.request_id, "its log expired (TTL) while waiting for events")

    async def not_found(self) -> RequestNotFound:
        """The error for a log missing at the start: the finished marker (kept for the
        idempotency window) tells a request that ended and whose log expired."""
        async with self._command():
            finished = await self.redis.exists(self.keys.finished(self.request_id))
        if finished:
            return RequestExpired(
                self.request_id,
                "it finished, and its log expired (TTL); its id is remembered for the "
                "idempotency window, its events are gone",
            )
        return RequestNotFound(self.request_id)

    async def next_live(self, inbox: Inbox, wait: float) -> list[Event]:
        """Wait up to ``wait`` seconds for live events; returns what they released."""
        if inbox.empty():
            try:
                # Not wait_for: on Python 3.11 it runs the get as a task of its own, a second
                # task step on every live event (3.12's wait_for is this timeout).
                async with asyncio.timeout(wait):
                    first = await inbox.get()
            except TimeoutError:
                return []
        else:
            first = inbox.get_nowait()
        messages = [first]
        while not inbox.empty():
            messages.append(inbox.get_nowait())
        if MISSED in messages:  # the connection was down: the log has what went by
            return await self.read_log()
        released: list[Event] = []
        for data in messages:
            assert data is not None
            released += self.ordering.offer(self._decode(data), hash(data))
        if self.ordering.waiting_for_gap:
            # The log holds everything up to the event just heard: fill the gap from there.
            released += await self.read_log()
        elif released:
            self.in_order_at = time.monotonic()
        return released

    def _command(self) -> contextlib.AbstractAsyncContextManager[object]:
        return self.commands if self.commands is not None else contextlib.nullcontext()

    def _decode(self, data: object) -> Event:
        event = decode_event(data, self.limits)
        if event.request_id != self.request_id:
            raise ProtocolError(
                "invalid_field",
                f"event for request {event.request_id!r} in the stream of {self.request_id!r}",
            )
        return event
