"""Following one request's events: the live channel merged with the replay log.

Subscribe first, then read the log from the start: anything published before the
subscription is in the log, anything after arrives live (and is in the log too, since every
event is appended and published atomically). Live events that skip a seq mean something was
missed, so the log is read again from where it was last read. While idle, the log is
re-read every ``recheck_interval`` seconds in case a publish was lost (e.g. across a
reconnect); that wait blocks on the socket, it never spins.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from protocol.cancellation import raise_if_cancelled
from protocol.codec import decode_event
from protocol.errors import ClientError, ProtocolError, RequestNotFound, StreamTimeout
from protocol.keys import Keys
from protocol.limits import Limits
from protocol.messages import Event
from protocol.ordering import EventOrdering
from protocol.scripts import read_log

SUBSCRIBE_CONFIRM_TIMEOUT = 10.0


async def follow_events(
    redis: Redis,
    keys: Keys,
    request_id: str,
    *,
    limits: Limits,
    timeout: float | None,
    recheck_interval: float,
) -> AsyncGenerator[Event, None]:
    """Yield the request's events in seq order until the terminal one (done or error).

    ``timeout``: most seconds to wait for the next event (None: no limit) before raising
    StreamTimeout. Raises RequestNotFound when there is no log, or it expires while waiting.
    """
    follower = _Follower(redis, keys, request_id, limits)
    pubsub = redis.pubsub()
    try:
        await _subscribe(pubsub, keys.out(request_id))
        released = await follower.read_log()
        if follower.log_cursor is None:
            raise RequestNotFound(request_id)
        last_event_at = time.monotonic()
        while True:
            raise_if_cancelled()
            for event in released:
                yield event
            if follower.ordering.finished:
                return
            if released:
                last_event_at = time.monotonic()
            now = time.monotonic()
            if timeout is not None and now - last_event_at >= timeout:
                raise StreamTimeout(f"request {request_id!r}: no event for {timeout:g} s")
            wait = recheck_interval - (now - follower.log_read_at)
            if timeout is not None:
                wait = min(wait, timeout - (now - last_event_at))
            released = await follower.next_live(pubsub, max(wait, 0.0))
            if not released and time.monotonic() - follower.log_read_at >= recheck_interval:
                released = await follower.recheck_log()
    finally:
        await _close(pubsub)


class _Follower:
    """The merge state of one subscription: where the log was read to, and the ordering."""

    def __init__(self, redis: Redis, keys: Keys, request_id: str, limits: Limits) -> None:
        self.redis = redis
        self.keys = keys
        self.request_id = request_id
        self.limits = limits
        self.ordering = EventOrdering()
        self.log_cursor: bytes | None = None
        self.log_read_at = time.monotonic()

    async def read_log(self) -> list[Event]:
        """Offer every log entry after the cursor; returns what that released."""
        entries = await read_log(self.redis, self.keys, self.request_id, after=self.log_cursor)
        self.log_read_at = time.monotonic()
        released: list[Event] = []
        for entry in entries:
            self.log_cursor = entry.stream_id
            if entry.seq >= 0:
                released += self.ordering.offer(self._decode(entry.data))
        return released

    async def recheck_log(self) -> list[Event]:
        """An idle re-read; a log that has vanished meanwhile has expired."""
        released = await self.read_log()
        if not released and not await self.redis.exists(self.keys.log(self.request_id)):
            raise RequestNotFound(self.request_id, "its log expired while waiting for events")
        return released

    async def next_live(self, pubsub: PubSub, wait: float) -> list[Event]:
        """Wait up to ``wait`` seconds for a live event; returns what it released."""
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=wait)
        if message is None or message.get("type") != "message":
            return []
        released = self.ordering.offer(self._decode(message["data"]))
        if self.ordering.waiting_for_gap:
            # The log holds everything up to the event just heard: fill the gap from there.
            released += await self.read_log()
        return released

    def _decode(self, data: object) -> Event:
        event = decode_event(data, self.limits)
        if event.request_id != self.request_id:
            raise ProtocolError(
                "invalid_field",
                f"event for request {event.request_id!r} in the stream of {self.request_id!r}",
            )
        return event


async def _subscribe(pubsub: PubSub, channel: str) -> None:
    """Subscribe and wait for the server's confirmation, so no later publish can be missed."""
    await pubsub.subscribe(channel)
    deadline = time.monotonic() + SUBSCRIBE_CONFIRM_TIMEOUT
    while (remaining := deadline - time.monotonic()) > 0:
        message = await pubsub.get_message(timeout=remaining)
        if message is not None and message.get("type") == "subscribe":
            return
    raise ClientError(f"Redis did not confirm the subscription to {channel}")


async def _close(pubsub: PubSub) -> None:
    # Closing drops the connection, and the server drops its subscription with it; an
    # UNSUBSCRIBE first could fail on a broken connection and hide the original error.
    await pubsub.aclose()  # type: ignore[no-untyped-call]
