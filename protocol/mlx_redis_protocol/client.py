"""The async client: submit jobs, follow their events, send control commands.

One Client holds one connection pool (per node, on a Redis Cluster) and one pub/sub
connection shared by all its streams, so it follows thousands of requests at once; at most
``max_in_flight`` of its commands are on the wire at a time, the others wait their turn.
``stream`` never loses, repeats or reorders an event (see `mlx_redis_protocol.subscription`).

A job naming a model goes to that model's stream once a live worker's heartbeat advertises
the model (protocol/mlx_redis_protocol/catalogue.py); otherwise the client ends the request itself
with an ``unknown_model`` error event and queues nothing, so its stream ends at once instead of
waiting for a worker that may never come.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import aclosing, asynccontextmanager, contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, TypeVar

from mlx_redis_protocol.catalogue import served_media
from mlx_redis_protocol.channels import ChannelHub
from mlx_redis_protocol.codec_job import decode_job, encode_job
from mlx_redis_protocol.connection import (
    RedisClient,
    connect,
    is_unavailable,
    redact,
    refresh_slot_map,
    until_available,
)
from mlx_redis_protocol.constants import (
    DEFAULT_ABORT_TTL_SECONDS,
    DEFAULT_CONTROL_TIMEOUT_SECONDS,
    DEFAULT_LOG_TTL_SECONDS,
    DEFAULT_PREFIX,
    DEFAULT_REDIS_URL,
    JOB_FIELD,
)
from mlx_redis_protocol.control import ControlReplies, abort_marker, send_command
from mlx_redis_protocol.embeddings import (
    EmbeddingCollector,
    EmbeddingInputs,
    Embeddings,
    embedding_job,
)
from mlx_redis_protocol.errors import ClientError, RedisUnavailable, StreamRewritten
from mlx_redis_protocol.identifiers import new_request_id
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.limits import DEFAULT_LIMITS, Limits
from mlx_redis_protocol.media_inputs import (
    DEFAULT_BLOB_TTL_SECONDS,
    DEFAULT_INLINE_MEDIA_BYTES,
    prepare_media,
)
from mlx_redis_protocol.messages import (
    TOOL_CHOICE_MODES,
    ChatMessage,
    ErrorEvent,
    Event,
    Job,
    QueuedEvent,
    TerminalEvent,
    ToolCall,
    ToolChoice,
)
from mlx_redis_protocol.registry import register_model
from mlx_redis_protocol.replay_log import publish_events
from mlx_redis_protocol.subscription import follow_events

if TYPE_CHECKING:
    from typing import Unpack

    from mlx_redis_protocol.messages import JobOptions

ChatInput = Sequence[Mapping[str, Any] | ChatMessage]
T = TypeVar("T")

# How long a Client trusts a catalogue read that found the model it submits to.
MODEL_CACHE_SECONDS: Final = 2.0


@dataclass(frozen=True, slots=True)
class CommandLoad:
    """How busy a Client's command bound is: commands on the wire, callers waiting their
    turn, and the bound."""

    in_flight: int
    waiting: int
    max_in_flight: int

    @property
    def saturated(self) -> bool:
        return self.waiting > 0


class Client:
    """An async client of the protocol. Use as ``async with Client(url) as client:``.

    ``redis_url``: ``redis://`` / ``rediss://`` (a single server or any node of a Redis
    Cluster, told apart on connect; ``topology`` can say which) or
    ``redis+sentinel://host:port[,host:port…]/service_name[/db]``. ``redis``: an existing
    ``decode_responses=False`` client to use instead (it is then not closed by this client).
    ``redis_options`` go to redis-py (TLS settings, timeouts, ...).

    Redis errors reach the caller as ``RedisUnavailable`` (unreachable, or no reply in time)
    or as redis-py's own ``ResponseError`` family (a refusal: authentication, ACL, ...).
    ``stream`` rides out outages shorter than its timeout and ``unavailable_timeout``; so do
    the commands (submit, abort, control commands, the catalogue read), each sent again while
    Redis is unreachable, for up to ``unavailable_timeout`` (every one is safe to send twice:
    a job queued twice still runs once). On a Redis Cluster the slot map is read again after
    every failed try, so a failover is followed to the promoted replica.
    ``retry_commands=False``: commands fail at once instead (a server that answers its own
    clients "unavailable, retry" rather than keep them waiting); the slot map is still read
    again first, so the next call follows a failover.
    ``require_worker``: a job naming a model no live worker serves ends with ``unknown_model``
    (default) instead of waiting in the model's stream for an autoscaler to start a worker.
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
        topology: str = "auto",
        max_in_flight: int = 64,
        unavailable_timeout: float = 60.0,
        require_worker: bool = True,
        retry_commands: bool = True,
        inline_media_bytes: int = DEFAULT_INLINE_MEDIA_BYTES,
        blob_ttl: int = DEFAULT_BLOB_TTL_SECONDS,
        redis: RedisClient | None = None,
        **redis_options: Any,
    ) -> None:
        if log_ttl < 1 or abort_ttl < 1:
            raise ValueError("log_ttl and abort_ttl must be at least 1 second")
        if recheck_interval <= 0 or unavailable_timeout <= 0:
            raise ValueError("recheck_interval and unavailable_timeout must be > 0")
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        if blob_ttl < 1 or inline_media_bytes < 0:
            raise ValueError("blob_ttl must be at least 1 second, inline_media_bytes >= 0")
        self.keys = Keys(prefix)
        self.log_ttl = log_ttl
        self.blob_ttl = blob_ttl
        self.inline_media_bytes = inline_media_bytes
        self.abort_ttl = abort_ttl
        self.limits = limits
        self.recheck_interval = recheck_interval
        self.unavailable_timeout = unavailable_timeout
        self.retry_commands = retry_commands
        self._url = redis_url
        self._topology = topology
        # Room for every command in flight plus the pub/sub connection.
        self._redis_options = {
            "socket_connect_timeout": connect_timeout,
            "max_connections": max_in_flight + 2,
            **redis_options,
        }
        self._owns_redis = redis is None
        self._redis = redis
        self._hub = ChannelHub(redis) if redis is not None else None
        self.max_in_flight = max_in_flight
        self._commands = asyncio.Semaphore(max_in_flight)
        self._connecting = asyncio.Lock()
        # The models live workers served at the last look, and when (monotonic seconds).
        # False: a job naming a model no live worker serves is queued anyway, on its stream
        # (for fleets an autoscaler grows from zero workers; the log TTL bounds its wait).
        self.require_worker = require_worker
        self._served: frozenset[str] = frozenset()
        self._media: dict[str, frozenset[str]] = {}  # what each served model takes
        self._served_at = -float("inf")
        # The catalogue read in progress, shared by every caller that wants one meanwhile (a
        # burst of submits after an idle spell reads it once, not once per submit).
        self._reading_served: asyncio.Future[frozenset[str]] | None = None

    @property
    def redis(self) -> RedisClient:
        """The redis-py client (after ``connect``, which every method does first)."""
        if self._redis is None:
            raise ClientError("not connected: use `async with Client(...)` or `await connect()`")
        return self._redis

    async def connect(self) -> RedisClient:
        """Open the connection (once): asks the server what it is (single, Cluster node)."""
        if self._redis is None:
            async with self._connecting:
                if self._redis is None:
                    with _unavailable_as(f"cannot connect to Redis at {redact(self._url)}"):
                        self._redis = await connect(
                            self._url, topology=self._topology, **self._redis_options
                        )
                    self._hub = ChannelHub(self._redis)
        return self._redis

    @asynccontextmanager
    async def command_slot(self) -> AsyncIterator[RedisClient]:
        """The client's Redis, with one of its ``max_in_flight`` command slots held while the
        block runs: a caller's own commands on the client's connections wait their turn with
        the client's, instead of taking connections the pool does not have."""
        redis = await self.connect()
        async with self._commands:
            yield redis

    def command_load(self) -> CommandLoad:
        """The command bound's load now (no Redis call)."""
        # The semaphore's own counters (typed in typeshed): no second count to keep in step.
        waiting = sum(1 for waiter in self._commands._waiters or () if not waiter.done())
        in_flight = self.max_in_flight - self._commands._value
        return CommandLoad(in_flight=in_flight, waiting=waiting, max_in_flight=self.max_in_flight)

    async def _retried(self, what: str, command: Callable[[RedisClient], Awaitable[T]]) -> T:
        """Run ``command`` (Redis commands safe to send twice), in one of the client's command
        slots per try, sent again while Redis is unreachable (see the class docstring);
        RedisUnavailable saying ``what`` it cost once the client gives up."""
        redis = await self.connect()

        async def once() -> T:
            async with self._commands:
                return await command(redis)

        with _unavailable_as(what):
            if self.retry_commands:
                return await until_available(once, redis, timeout=self.unavailable_timeout)
            try:
                return await once()
            except Exception as exc:
                if is_unavailable(exc):
                    await refresh_slot_map(redis)
                raise

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the pub/sub connection and the pool (unless the client was handed in)."""
        if self._hub is not None:
            await self._hub.aclose()
            self._hub = None
        if self._owns_redis and self._redis is not None:
            await self._redis.aclose()
            self._redis = None

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

        ``model=NAME`` (an option, like the sampling fields) names the fleet's model to run it
        with: see ``submit_job`` for what happens when no live worker serves it.
        ``images`` and ``videos`` (options): bytes, paths or ``ImageInput``/``VideoInput``,
        a video also as a list of frames; a file over ``inline_media_bytes`` is stored in a
        blob (``blob_ttl``) that the job references.
        Raises ProtocolError (before touching Redis) if the job would be invalid.
        """
        fields: dict[str, Any] = dict(options)
        blobs: dict[str, bytes] = {}
        if fields.get("images") or fields.get("videos"):
            staged = prepare_media(
                fields.pop("images", ()),
                fields.pop("videos", ()),
                self.limits,
                self.inline_media_bytes,
            )
            fields["images"], fields["videos"], blobs = staged.images, staged.videos, staged.blobs
        job = build_job(
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            messages=messages,
            request_id=request_id,
            options={name: value for name, value in fields.items() if value is not None},
            limits=self.limits,
        )
        return await self.submit_job(job, blobs=blobs)

    async def store_blob(self, blob_id: str, data: bytes) -> None:
        """Store a media file under ``blob_id`` for a job to reference (with ``blob_ttl``)."""
        key = self.keys.blob(blob_id)
        await self._retried(
            f"blob {blob_id!r} was not stored",
            lambda redis: redis.set(key, data, ex=self.blob_ttl),
        )

    async def submit_job(self, job: Job, *, blobs: Mapping[str, bytes] | None = None) -> str:
        """Queue an already built Job; returns its request id. ``blobs`` (blob id -> file):
        the media files the job references, stored just before it is queued (not for a job
        refused here: it leaves nothing behind).

        A job naming a ``model`` goes to that model's stream when a live worker serves it;
        when none does, the request ends at once with an ``unknown_model`` error event (its
        stream yields it) and nothing is queued (unless ``require_worker`` is off). A job
        naming none goes to the default stream.

        Sent again while Redis is unreachable (see the class docstring): a retry after a lost
        reply may queue the job twice, and a job queued twice runs once (the request id is its
        idempotency key). When the client gives up, RedisUnavailable says whether the job may
        have been queued.
        """
        data = encode_job(job)
        decode_job(data, self.limits)  # the decoder is the one definition of "valid"
        stream = self.keys.jobs
        if job.model is not None:
            served = await self._models_for(job.model) if self.require_worker else None
            if served is not None and job.model not in served:
                listed = ", ".join(sorted(served)) or "none"
                message = f"no live worker serves model {job.model!r} (served: {listed})"
                await self._refuse(job, "unknown_model", message)
                return job.request_id
            missing = _media_kinds(job) - self._media.get(job.model, frozenset())
            if served is not None and missing:
                message = (
                    f"invalid_field: model {job.model!r} does not take "
                    f"{' or '.join(sorted(kind + 's' for kind in missing))}"
                )
                await self._refuse(job, "invalid_job", message)
                return job.request_id
            stream = self.keys.model_stream(job.model).stream
        for blob_id, blob in (blobs or {}).items():
            await self.store_blob(blob_id, blob)
        # The queued marker goes first, so a subscriber arriving any time after this call
        # finds the log. Two commands, not MULTI: in a Cluster they live on different slots.
        queued = QueuedEvent(request_id=job.request_id, seq=0, attempt=0)

        async def mark_queued(redis: RedisClient) -> None:
            await publish_events(redis, self.keys, [queued], ttl_seconds=self.log_ttl)
            if job.model is not None and not self.require_worker:
                # Unchecked, perhaps for a model no worker serves yet: the registry lists
                # it, so the catalogue (an autoscaler) sees its queue.
                await register_model(redis, self.keys, job.model)

        await self._retried(f"job {job.request_id!r} was not queued", mark_queued)
        await self._retried(
            f"job {job.request_id!r} may or may not have been queued",
            lambda redis: redis.xadd(stream, {JOB_FIELD: data}),
        )
        return job.request_id

    async def served_models(self) -> frozenset[str]:
        """The models live workers serve now (their heartbeats advertise them). Callers that
        ask while a read is under way share its answer."""
        if self._reading_served is None or self._reading_served.done():
            self._reading_served = asyncio.ensure_future(self._read_served())
        return await asyncio.shield(self._reading_served)

    async def _read_served(self) -> frozenset[str]:
        media = await self._retried(
            "the fleet's models could not be read",
            lambda redis: served_media(redis, self.keys),
        )
        served = frozenset(media)
        self._served, self._media, self._served_at = served, media, time.monotonic()
        return served

    async def serves(self, model: str) -> bool:
        """Whether a live worker serves ``model`` (a positive answer is cached briefly)."""
        return model in await self._models_for(model)

    async def media_of(self, model: str) -> frozenset[str]:
        """The media ``model``'s live workers say it takes ("image", "video"; none for a
        text-only model or one no live worker serves)."""
        await self._models_for(model)
        return self._media.get(model, frozenset())

    async def _models_for(self, model: str) -> frozenset[str]:
        """The served models, for a job naming ``model``: a read that found it is trusted
        for ``MODEL_CACHE_SECONDS`` (a burst of submits scans Redis once); without it, the
        catalogue is always read afresh."""
        fresh = time.monotonic() - self._served_at < MODEL_CACHE_SECONDS
        if fresh and model in self._served:
            return self._served
        return await self.served_models()

    async def _refuse(self, job: Job, code: str, message: str) -> None:
        """End a request the fleet cannot run (its model no live worker serves, or does not
        take its media): its queued marker and a terminal error (attempt 0: no worker ran
        it), in one script call, so whoever follows the request sees it end. The job itself
        is not queued."""
        events: list[Event] = [
            QueuedEvent(request_id=job.request_id, seq=0, attempt=0),
            ErrorEvent(
                request_id=job.request_id,
                seq=1,
                attempt=0,
                code=code,
                message=message,
                metadata=job.metadata,
            ),
        ]
        await self._retried(
            f"job {job.request_id!r} was not queued ({code})",
            lambda redis: publish_events(redis, self.keys, events, ttl_seconds=self.log_ttl),
        )

    def stream(
        self, request_id: str, *, timeout: float | None = None
    ) -> AsyncGenerator[Event, None]:
        """The request's events in seq order, ending with its done or error event.

        Works before the job starts, while it runs and after it finished, as long as its log
        exists; raises RequestNotFound otherwise. ``timeout`` bounds the wait for each next
        event (StreamTimeout). Close it when leaving early: ``async with aclosing(...)``.
        """
        self.keys.out(request_id)  # an invalid id fails here, not inside the generator
        return self._events(request_id, timeout)

    async def _events(self, request_id: str, timeout: float | None) -> AsyncGenerator[Event, None]:
        redis = await self.connect()
        assert self._hub is not None
        events = follow_events(
            redis,
            self._hub,
            self.keys,
            request_id,
            limits=self.limits,
            timeout=timeout,
            recheck_interval=self.recheck_interval,
            unavailable_timeout=self.unavailable_timeout,
            commands=self._commands,
        )
        async with aclosing(events):
            async for event in events:
                yield event

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

    async def embed(
        self,
        inputs: EmbeddingInputs,
        *,
        model: str | None = None,
        dimensions: int | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        **options: Any,
    ) -> Embeddings:
        """Embed ``inputs`` (a text, texts, or token-id lists) with an embedding model of the
        fleet and wait for the vectors, one per input in order. ``dimensions``: shorter
        vectors, where the model documents them. ``options``: ``tenant``, ``priority``,
        ``metadata``, ``deadline``. Raises ``EmbeddingFailed`` when the job fails (an
        ``unknown_model``, an input over the model's limits: its ``code`` says which)."""
        job = embedding_job(
            inputs, model=model, dimensions=dimensions, request_id=request_id, **options
        )
        await self.submit_job(job)
        assert job.input is not None
        while True:
            collector = EmbeddingCollector(job.request_id)
            try:
                async with aclosing(self.stream(job.request_id, timeout=timeout)) as events:
                    async for event in events:
                        collector.feed(event)
                        if collector.finished:
                            return collector.result(len(job.input))
            except StreamRewritten:
                continue
            raise ClientError(f"request {job.request_id!r}: events ended without done or error")

    async def wait(self, request_id: str, *, timeout: float | None = None) -> TerminalEvent:
        """Follow a request to its done or error event and return that (following it again
        from the start if its history was rewritten under the stream)."""
        while True:
            try:
                async with aclosing(self.stream(request_id, timeout=timeout)) as events:
                    async for event in events:
                        if isinstance(event, TerminalEvent):
                            return event
            except StreamRewritten:
                continue
            raise ClientError(f"request {request_id!r}: events ended without done or error")

    async def abort(
        self,
        request_id: str,
        *,
        model: str | None = None,
        timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS,
    ) -> ControlReplies:
        """Stop a request wherever it is; returns the workers' replies (maybe none).

        The marker stops a job still in the queue from ever starting, and a running one within
        about a second; the broadcast is faster: the worker running it stops it, and a job no
        worker has begun is ended where it waits. Its stream ends with ``done`` /
        ``finish_reason="abort"``. Each reply's ``result`` is ``{"aborted": bool, "state":
        "running" | "queued" | "finished" | "elsewhere"}``, or an error ``not_found`` when the
        request is unknown (see protocol/README.md, Control commands). With ``model``, only
        workers serving that model act on the broadcast (and answer), on that model's jobs
        only; the marker (whose value names the model) works alike.
        """
        await self._retried(
            f"abort of {request_id!r} not recorded",
            lambda redis: redis.set(
                self.keys.abort(request_id), abort_marker(model), ex=self.abort_ttl
            ),
        )
        return await self._command(
            "abort", None, timeout, request_id=request_id, model=model, required=False
        )

    async def stats(
        self,
        *,
        worker_id: str | None = None,
        model: str | None = None,
        timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS,
    ) -> ControlReplies:
        return await self._command("stats", worker_id, timeout, model=model)

    async def ping(
        self,
        *,
        worker_id: str | None = None,
        model: str | None = None,
        timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS,
    ) -> ControlReplies:
        return await self._command("ping", worker_id, timeout, model=model)

    async def cache_save(
        self,
        name: str,
        *,
        worker_id: str | None = None,
        model: str | None = None,
        timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS,
    ) -> ControlReplies:
        return await self._command("cache_save", worker_id, timeout, name=name, model=model)

    async def cache_load(
        self,
        name: str,
        *,
        worker_id: str | None = None,
        model: str | None = None,
        timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS,
    ) -> ControlReplies:
        return await self._command("cache_load", worker_id, timeout, name=name, model=model)

    async def cache_clear(
        self,
        *,
        worker_id: str | None = None,
        model: str | None = None,
        timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS,
    ) -> ControlReplies:
        return await self._command("cache_clear", worker_id, timeout, model=model)

    async def _command(
        self,
        kind: str,
        worker_id: str | None,
        timeout: float,
        *,
        request_id: str | None = None,
        name: str | None = None,
        model: str | None = None,
        required: bool = True,
    ) -> ControlReplies:
        # Sent again whole after a failure (a fresh command id): every command is safe to
        # act on twice (a second abort, stats or cache command changes nothing more).
        return await self._retried(
            f"control command {kind!r}",
            lambda redis: send_command(
                redis,
                self.keys,
                kind,
                timeout=timeout,
                limits=self.limits,
                worker_id=worker_id,
                request_id=request_id,
                name=name,
                model=model,
                require_reply=required,
            ),
        )


@contextmanager
def _unavailable_as(what: str) -> Iterator[None]:
    """Redis being unreachable reaches callers as RedisUnavailable, saying what it cost."""
    try:
        yield
    except Exception as exc:
        if is_unavailable(exc):
            raise RedisUnavailable(
                f"{what}: Redis unreachable ({type(exc).__name__}: {exc})"
            ) from exc
        raise


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
    if "tool_choice" in fields:
        fields["tool_choice"] = as_tool_choice(fields["tool_choice"])
    job = Job(
        request_id=request_id if request_id is not None else new_request_id(),
        prompt=prompt,
        prompt_token_ids=tuple(prompt_token_ids) if prompt_token_ids is not None else None,
        messages=tuple(_chat_message(turn) for turn in messages) if messages is not None else None,
        **fields,
    )
    return decode_job(encode_job(job), limits)


def _media_kinds(job: Job) -> frozenset[str]:
    """The media a job carries: "image", "video"."""
    return frozenset(
        kind for kind, items in (("image", job.images), ("video", job.videos)) if items
    )


def _chat_message(turn: Mapping[str, Any] | ChatMessage) -> ChatMessage:
    if isinstance(turn, ChatMessage):
        return turn
    calls = turn.get("tool_calls")
    return ChatMessage(
        role=turn.get("role", ""),
        content=turn.get("content") or "",
        tool_calls=tuple(_tool_call(call) for call in calls) if calls else None,
        tool_call_id=turn.get("tool_call_id"),
        name=turn.get("name"),
    )


def _tool_call(call: Mapping[str, Any] | ToolCall) -> ToolCall:
    if isinstance(call, ToolCall):
        return call
    return ToolCall(
        id=call.get("id", ""), name=call.get("name", ""), arguments=call.get("arguments", "")
    )


def as_tool_choice(value: object) -> object:
    """``tool_choice`` as given to ``submit``: a ToolChoice, a mode's name or ``{"name":
    …}``; anything else goes on as it is, for the decoder to refuse."""
    if isinstance(value, str) and value in TOOL_CHOICE_MODES:
        return ToolChoice(TOOL_CHOICE_MODES[TOOL_CHOICE_MODES.index(value)])
    if isinstance(value, Mapping) and isinstance(value.get("name"), str):
        return ToolChoice("function", value["name"])
    return value
