"""The async client: submit jobs, follow their events, send control commands.

One Client holds one connection pool; every method borrows from it. ``stream`` never loses,
repeats or reorders an event (see `protocol.subscription`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
from types import TracebackType
from typing import TYPE_CHECKING, Any

import redis.asyncio as redis_asyncio
from redis.asyncio import Redis

from protocol.codec import decode_job, encode_job
from protocol.constants import (
    DEFAULT_ABORT_TTL_SECONDS,
    DEFAULT_CONTROL_TIMEOUT_SECONDS,
    DEFAULT_LOG_TTL_SECONDS,
    DEFAULT_PREFIX,
    DEFAULT_REDIS_URL,
    JOB_FIELD,
)
from protocol.control import send_command
from protocol.errors import ClientError
from protocol.identifiers import new_request_id
from protocol.keys import Keys
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import ChatMessage, ControlReply, Event, Job, QueuedEvent, TerminalEvent
from protocol.scripts import publish_events
from protocol.subscription import follow_events

if TYPE_CHECKING:
    from typing import Unpack

    from protocol.messages import JobOptions

ChatInput = Sequence[Mapping[str, str] | ChatMessage]


class Client:
    """An async client of the protocol. Use as ``async with Client(url) as client:``.

    ``redis``: an existing ``decode_responses=False`` client to use instead of opening a pool
    from ``redis_url`` (it is then not closed by this client). ``redis_options`` go to
    ``redis.asyncio.from_url`` (TLS settings, retries, ...).
    """

    def __init__(
        self,
        redis_url: str = DEFAULT_REDIS_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        log_ttl: int = DEFAULT_LOG_TTL_SECONDS,
        abort_ttl: int = DEFAULT_ABORT_TTL_SECONDS,
        limits: Limits = DEFAULT_LIMITS,
        recheck_interval: float = 2.0,
        connect_timeout: float = 5.0,
        redis: Redis | None = None,
        **redis_options: Any,
    ) -> None:
        if log_ttl < 1 or abort_ttl < 1:
            raise ValueError("log_ttl and abort_ttl must be at least 1 second")
        if recheck_interval <= 0:
            raise ValueError("recheck_interval must be > 0")
        self.keys = Keys(prefix)
        self.log_ttl = log_ttl
        self.abort_ttl = abort_ttl
        self.limits = limits
        self.recheck_interval = recheck_interval
        self._owns_redis = redis is None
        self.redis: Redis = redis or redis_asyncio.from_url(
            redis_url,
            decode_responses=False,
            socket_connect_timeout=connect_timeout,
            **redis_options,
        )

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool (unless it was handed in)."""
        if self._owns_redis:
            await self.redis.aclose()

    async def submit(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        messages: ChatInput | None = None,
        request_id: str | None = None,
        **options: Unpack[JobOptions],
    ) -> str:
        """Queue a job; returns its request id (``request_id`` or a fresh one).

        Raises ProtocolError (before touching Redis) if the job would be invalid.
        """
        job = build_job(
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            messages=messages,
            request_id=request_id,
            options=options,
            limits=self.limits,
        )
        return await self.submit_job(job)

    async def submit_job(self, job: Job) -> str:
        """Queue an already built Job; returns its request id."""
        data = encode_job(job)
        decode_job(data, self.limits)  # the decoder is the one definition of "valid"
        # The queued marker goes first, so a subscriber arriving any time after this call
        # finds the log. Two commands, not MULTI: in a Cluster they live on different slots.
        queued = QueuedEvent(request_id=job.request_id, seq=0, attempt=0)
        await publish_events(self.redis, self.keys, [queued], ttl_seconds=self.log_ttl)
        await self.redis.xadd(self.keys.jobs, {JOB_FIELD: data})
        return job.request_id

    def stream(
        self, request_id: str, *, timeout: float | None = None
    ) -> AsyncGenerator[Event, None]:
        """The request's events in seq order, ending with its done or error event.

        Works before the job starts, while it runs and after it finished, as long as its log
        exists; raises RequestNotFound otherwise. ``timeout`` bounds the wait for each next
        event (StreamTimeout). Close it when leaving early: ``async with aclosing(...)``.
        """
        self.keys.out(request_id)  # an invalid id fails here, not inside the generator
        return follow_events(
            self.redis,
            self.keys,
            request_id,
            limits=self.limits,
            timeout=timeout,
            recheck_interval=self.recheck_interval,
        )

    async def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        messages: ChatInput | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        **options: Unpack[JobOptions],
    ) -> TerminalEvent:
        """Submit and wait for the end: the DoneEvent (with the whole text) or ErrorEvent."""
        request_id = await self.submit(
            prompt,
            prompt_token_ids=prompt_token_ids,
            messages=messages,
            request_id=request_id,
            **options,
        )
        return await self.wait(request_id, timeout=timeout)

    async def wait(self, request_id: str, *, timeout: float | None = None) -> TerminalEvent:
        """Follow a request to its done or error event and return that."""
        async with aclosing(self.stream(request_id, timeout=timeout)) as events:
            async for event in events:
                if isinstance(event, TerminalEvent):
                    return event
        raise ClientError(f"request {request_id!r}: events ended without done or error")

    async def abort(
        self, request_id: str, *, timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS
    ) -> list[ControlReply]:
        """Stop a request wherever it is; returns the workers' replies (maybe none).

        The marker stops a job still in the queue from ever starting; the broadcast stops it
        on the worker running it. Its stream ends with ``done`` / ``finish_reason="abort"``.
        """
        await self.redis.set(self.keys.abort(request_id), b"1", ex=self.abort_ttl)
        return await self._command("abort", None, timeout, request_id=request_id, required=False)

    async def stats(
        self, *, worker_id: str | None = None, timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS
    ) -> list[ControlReply]:
        return await self._command("stats", worker_id, timeout)

    async def ping(
        self, *, worker_id: str | None = None, timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS
    ) -> list[ControlReply]:
        return await self._command("ping", worker_id, timeout)

    async def cache_save(
        self,
        name: str,
        *,
        worker_id: str | None = None,
        timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS,
    ) -> list[ControlReply]:
        return await self._command("cache_save", worker_id, timeout, name=name)

    async def cache_load(
        self,
        name: str,
        *,
        worker_id: str | None = None,
        timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS,
    ) -> list[ControlReply]:
        return await self._command("cache_load", worker_id, timeout, name=name)

    async def cache_clear(
        self, *, worker_id: str | None = None, timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS
    ) -> list[ControlReply]:
        return await self._command("cache_clear", worker_id, timeout)

    async def _command(
        self,
        kind: str,
        worker_id: str | None,
        timeout: float,
        *,
        request_id: str | None = None,
        name: str | None = None,
        required: bool = True,
    ) -> list[ControlReply]:
        return await send_command(
            self.redis,
            self.keys,
            kind,
            timeout=timeout,
            limits=self.limits,
            worker_id=worker_id,
            request_id=request_id,
            name=name,
            require_reply=required,
        )


def build_job(
    *,
    prompt: str | None,
    prompt_token_ids: Sequence[int] | None,
    messages: ChatInput | None,
    request_id: str | None,
    options: Mapping[str, Any],
    limits: Limits = DEFAULT_LIMITS,
) -> Job:
    """A validated Job from client-side arguments (ProtocolError if invalid)."""
    fields: dict[str, Any] = {
        name: tuple(value) if isinstance(value, list | tuple) else value
        for name, value in options.items()
    }
    job = Job(
        request_id=request_id if request_id is not None else new_request_id(),
        prompt=prompt,
        prompt_token_ids=tuple(prompt_token_ids) if prompt_token_ids is not None else None,
        messages=tuple(_chat_message(turn) for turn in messages) if messages is not None else None,
        **fields,
    )
    return decode_job(encode_job(job), limits)


def _chat_message(turn: Mapping[str, str] | ChatMessage) -> ChatMessage:
    if isinstance(turn, ChatMessage):
        return turn
    return ChatMessage(role=turn.get("role", ""), content=turn.get("content", ""))
