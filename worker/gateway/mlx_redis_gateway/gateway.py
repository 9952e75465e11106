"""What every route shares: the protocol client, the keys and quotas, reading a request's
body, queuing its job, and following the job's answer to the client (one JSON body, or an SSE
stream), with what happens when the client leaves first.

A gateway holds no state but Redis: each request becomes a job (``mlx_redis_protocol.client``),
its answer is read from the request's replay log, and what another gateway needs to stream it
again (the answer's shape and owner) is a key beside the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any, Final, Protocol, TypeVar

import structlog
from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import AppStatus
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Scope

from mlx_redis_gateway.anthropic_shaping import AnthropicPing, MessageFrames, message_object
from mlx_redis_gateway.api_keys import ApiKey, KeyFile
from mlx_redis_gateway.auth import Authenticator
from mlx_redis_gateway.browser_guard import require_json
from mlx_redis_gateway.errors import ApiError
from mlx_redis_gateway.http_limits import read_json
from mlx_redis_gateway.media_parts import MediaResolver
from mlx_redis_gateway.openai_api import CompletionRequest
from mlx_redis_gateway.quotas import Quotas, read_lease
from mlx_redis_gateway.redis_health import HealthProbe
from mlx_redis_gateway.settings import GatewaySettings
from mlx_redis_gateway.shaping import DONE_MESSAGE, ResponseShape, Shaper, sse_data, sse_message
from mlx_redis_gateway.token_meter import prompt_token_bound
from mlx_redis_protocol.client import Client
from mlx_redis_protocol.connection import is_unavailable
from mlx_redis_protocol.errors import (
    ClientError,
    RedisUnavailable,
    RequestNotFound,
    StreamRewritten,
    StreamTimeout,
)
from mlx_redis_protocol.messages import Event, Job
from mlx_redis_protocol.redis_retry import REDIS_FAILURES, describe
from mlx_redis_protocol.supervisor import supervise

log = structlog.get_logger(__name__)
T = TypeVar("T")

# The header (or body field ``resumable``) by which a client says its stream may be resumed:
# its disconnect then leaves the job running instead of aborting it.
RESUMABLE_HEADER: Final = "x-resumable"
# SSE comments sent on a quiet stream, so proxies and clients do not time it out.
PING_SECONDS: Final = 15
# How long a request aborted for its client's leaving is followed to its end, for its token
# charge to be settled by its usage (past that it keeps what it was charged).
SETTLE_AFTER_ABORT_SECONDS: Final = 10.0
# Refusals of a keyed request before its admission that count as one of the key's requests:
# invalid (400) and a model no worker serves (404).
REFUSALS_CHARGED: Final = frozenset({400, 404})


class Gateway:
    """The routes' shared parts: the protocol client, the keys, the quotas."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.client = Client(
            settings.redis_url,
            prefix=settings.prefix,
            log_ttl=settings.log_ttl,
            limits=settings.limits,
            topology=settings.redis_topology,
            max_in_flight=256,
            # A request that finds Redis unreachable is answered 503 at once, for the HTTP
            # client to retry, rather than held open while Redis is away.
            retry_commands=False,
        )
        self.media = MediaResolver(settings.fetch_policy, settings.limits, self.client.store_blob)
        self.keys = KeyFile(settings.api_keys) if settings.api_keys is not None else None
        self.auth = Authenticator(self.keys)
        self.health = HealthProbe(self.client)
        self._quotas: Quotas | None = None
        self._background: set[asyncio.Task[None]] = set()

    @property
    def quotas(self) -> Quotas:
        assert self._quotas is not None, "the gateway has not started"
        return self._quotas

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.client.connect()
        self._quotas = Quotas(
            self.client.command_slot, self.client.keys, self.settings.quota_lease_seconds
        )
        # Supervised: a lease keeper that died would let every in-flight request's lease
        # lapse, and the quotas count them free while they still run.
        leases = asyncio.create_task(
            supervise("quota leases", self.quotas.keep_leases), name="quota leases"
        )
        # Supervised too: streamed tokens left unsent would be charged to nobody.
        charges = asyncio.create_task(
            supervise("token charges", self.quotas.meter.keep_charging), name="token charges"
        )
        log.info(
            "gateway_ready",
            auth=self.keys is not None,
            keys=len(self.keys) if self.keys is not None else 0,
            prefix=self.settings.prefix,
        )
        try:
            yield
        finally:
            leases.cancel()
            charges.cancel()
            for task in list(self._background):
                task.cancel()
            await asyncio.gather(leases, charges, *self._background, return_exceptions=True)
            await self.quotas.close()
            await self.client.aclose()

    # -- a request in ------------------------------------------------------------------------

    async def charge_refused_body(self, scope: Scope) -> None:
        """A body refused for its size counts as a request of its key (when it has a valid
        one and the key's quota has a request left): a key cannot send oversized bodies
        faster than it may send requests. The refusal is a 413 whatever this finds."""
        if self.settings.api_keys is None:
            return
        try:
            key = self.auth.api_key(Request(scope))
        except ApiError:
            return  # no key, or a wrong one: only the address's cool-down counts it
        assert key is not None
        await self._charge_refused(key)

    @asynccontextmanager
    async def screening(self, key: ApiKey | None) -> AsyncIterator[None]:
        """A request's body read and checked, before its key's quota admits it. A key this
        gateway knows is refused (it came back before its Retry-After, or holds all its
        slots here) gets its 429 before its body is read; a request refused as invalid (400)
        or for a model no worker serves (404) counts as one of its key's requests, like a
        body refused for its size: a key cannot make the gateway read, parse and refuse
        bodies (a picture for a text model: 1 MB of JSON each) faster than it may send
        requests."""
        if key is not None:
            await self.quotas.refuse_known(key)
        try:
            yield
        except ApiError as error:
            if key is not None and error.status in REFUSALS_CHARGED:
                await self._charge_refused(key)
            raise

    async def _charge_refused(self, key: ApiKey) -> None:
        lease = f"refused-{uuid.uuid4().hex}"
        try:
            if await self.quotas.admit(key, lease) is None:
                await self.quotas.release(lease)
        except (RedisUnavailable, *REDIS_FAILURES) as exc:
            log.warning("refused_request_not_charged", api_key=key.name, error=describe(exc))

    async def json_body(self, request: Request) -> Any:
        require_json(request)
        return read_json(await request.body(), self.settings.http.max_json_depth)

    async def check_served(self, model: str) -> None:
        if not await self.client.serves(model):
            raise ApiError(
                404,
                f"the model {model!r} does not exist or no live worker serves it",
                param="model",
                code="model_not_found",
            )

    async def check_media(self, accepted: CompletionRequest) -> None:
        """A request with images for a model whose workers take none: 400 before anything."""
        if accepted.job.images and "image" not in await self.client.media_of(accepted.model):
            raise ApiError(
                400,
                f"the model {accepted.model!r} does not take images",
                param="messages",
                code="invalid_job",
            )

    async def with_media(self, accepted: CompletionRequest) -> CompletionRequest:
        """An admitted request's images made ready to queue: URLs fetched, big files stored
        as blobs. After admission: a request over its quota costs no fetch and no Redis
        memory."""
        if not accepted.job.images:
            return accepted
        return accepted.with_job(await self.media.resolve(accepted.job, accepted.blobs))

    async def admit_and_submit(
        self, accepted: CompletionRequest, key: ApiKey | None
    ) -> ResponseShape:
        """Queue a request of one job, once its key's quota admits it (429 otherwise); its
        quota lease (and tokens) are given back if it could not be queued."""
        request_id = accepted.request_id
        if key is not None:
            tokens = prompt_token_bound(accepted.job)
            await self.quotas.admit_or_refuse(key, request_id, tokens=tokens)
        try:
            shape = self.shape(accepted, key)
            accepted = await self.with_media(accepted)
            await self.queue(accepted.job, shape)
        except BaseException:
            await self.quotas.withdraw(request_id)
            raise
        return shape

    def shape(self, accepted: CompletionRequest, key: ApiKey | None) -> ResponseShape:
        return ResponseShape(
            kind=accepted.kind,
            model=accepted.model,
            created=int(time.time()),
            include_usage=accepted.include_usage,
            logprobs=accepted.logprobs,
            owner=key.name if key is not None else None,
        )

    async def queue(self, job: Job, shape: ResponseShape) -> None:
        """Queue ``job``, its answer's shape beside its log."""
        key_of_shape = self.client.keys.gateway_request(job.request_id)

        async def write_shape() -> None:
            async with self.client.command_slot() as redis:
                await redis.set(key_of_shape, shape.encode(), ex=self.settings.log_ttl)

        try:
            # Side by side (one round trip of waiting, not two): nobody can ask to resume the
            # request before this answer gives its id, and by then both are written.
            await asyncio.gather(write_shape(), self.client.submit_job(job))
        except Exception as exc:
            if isinstance(exc, RedisUnavailable) or is_unavailable(exc):
                raise unavailable(exc) from exc
            raise

    def resumable(self, request: Request, accepted: CompletionRequest) -> bool:
        header = request.headers.get(RESUMABLE_HEADER)
        if header is not None:
            return header.strip().lower() in ("1", "true", "yes", "on")
        if accepted.resumable is not None:
            return accepted.resumable
        return self.settings.resumable_by_default

    async def admit_read(self, key: ApiKey | None, subject: str) -> str | None:
        """A quota lease for one read of ``subject`` (a request, a stored response; None
        without keys): reads count against their key's rate and concurrency like
        completions, so a key cannot flood the gateway with reads that use no quota."""
        if key is None:
            return None
        lease = read_lease(subject)
        await self.quotas.admit_or_refuse(key, lease, holder=subject)
        return lease

    async def release_read(self, lease: str | None) -> None:
        if lease is not None:
            await self.quotas.release(lease)

    @asynccontextmanager
    async def reading(self, key: ApiKey | None, subject: str) -> AsyncIterator[None]:
        """A read of ``subject`` under its quota lease (``admit_read``)."""
        lease = await self.admit_read(key, subject)
        try:
            yield
        finally:
            await self.release_read(lease)

    # -- its answer out ----------------------------------------------------------------------

    async def finished(
        self, request: Request, request_id: str, shape: ResponseShape, *, resumable: bool
    ) -> Shaper | None:
        """A request of one job followed to its end (its lease then released), or None when
        its client left first (its job is then aborted, or kept for a resume)."""
        return await self.until_disconnected(
            request, self.follow(request_id, shape), on_left=self.left(request_id, resumable)
        )

    async def events(self, request_id: str) -> AsyncIterator[Event]:
        """The request's events; a failure to follow it ends as an ApiError. A request this
        gateway admitted under a tokens-per-minute limit is charged its tokens as they pass
        (its ``done`` settles the charge before it is handed on)."""
        events = self.client.stream(request_id, timeout=self.settings.event_timeout)
        meter = self.quotas.meter
        try:
            async with aclosing(events):
                async for event in events:
                    if event.terminal:
                        await meter.settle(request_id, event)
                    else:
                        meter.count(request_id, event)
                    yield event
        except RequestNotFound as exc:
            raise ApiError(404, str(exc), code="request_not_found") from exc
        except StreamTimeout as exc:
            raise ApiError(504, str(exc), "server_error", code="timeout") from exc
        except StreamRewritten as exc:
            raise ApiError(500, str(exc), "server_error", code="stream_rewritten") from exc
        except RedisUnavailable as exc:
            raise ApiError(503, str(exc), "server_error", code="unavailable") from exc

    async def follow(
        self, request_id: str, shape: ResponseShape, *, holds_lease: bool = True
    ) -> Shaper:
        """Follow a request to its end; the shaper holds the answer (or its error). Nothing
        was sent yet, so history rewritten under us (a failover) is followed again."""
        try:
            while True:
                shaper = Shaper(request_id, shape, streaming=False)
                try:
                    async for event in self.events(request_id):
                        shaper.feed(event)
                        if shaper.finished:
                            break
                except ApiError as error:
                    if error.code == "stream_rewritten":
                        continue
                    raise
                return shaper
        finally:
            if holds_lease and not _cancelled():
                await self.quotas.release(request_id)

    async def serve(
        self, request: Request, accepted: CompletionRequest, key: ApiKey | None
    ) -> Response:
        """A request of one job: queued once its key's quota admits it, then its answer
        streamed in its API's events or sent whole."""
        request_id = accepted.request_id
        shape = await self.admit_and_submit(accepted, key)
        resumable = self.resumable(request, accepted)
        structlog.contextvars.bind_contextvars(request_id=request_id)
        log.info(
            "gateway_request", kind=accepted.kind, model=accepted.model, stream=accepted.stream
        )
        if accepted.stream:
            return self.stream_response(request_id, shape, after=-1, abort_when_left=not resumable)
        shaper = await self.finished(request, request_id, shape, resumable=resumable)
        return client_left() if shaper is None else answer(shaper)

    def stream_response(
        self,
        request_id: str,
        shape: ResponseShape,
        *,
        after: int,
        abort_when_left: bool,
        lease: str | None = None,
    ) -> Response:
        """The request's stream in its API's events; ``lease``: a read's quota lease, given
        back when the stream ends."""
        frames = frames_for(request_id, shape)
        messages = self._sse(frames, after, abort_when_left)
        return event_stream(
            messages if lease is None else self._releasing(messages, lease),
            request_id,
            anthropic=shape.kind == "messages",
        )

    async def _sse(
        self, frames: Frames, after: int, abort_when_left: bool
    ) -> AsyncGenerator[bytes, None]:
        """The SSE messages of a request, after seq ``after``: its opening, each event's
        messages, its end (or an error). A client that leaves first aborts the job when
        ``abort_when_left`` (and the gateway is configured to)."""
        shaper = frames.shaper
        ended = False
        try:
            if after < 0:
                yield frames.opening()
            try:
                async for event in self.events(shaper.request_id):
                    # An event's messages (and the end) leave in one write.
                    messages = frames.feed(event, after)
                    if messages:
                        yield messages
                    if shaper.finished:
                        break
            except ApiError as error:
                shaper.error = error
                yield frames.failed(error)
            ended = True
        finally:
            self.stream_ended(shaper, ended=ended, abort_when_left=abort_when_left)

    def stream_ended(self, shaper: Shaper, *, ended: bool, abort_when_left: bool) -> None:
        """A stream is over: its request's client left before its end (then the job is
        aborted, or kept for a resume), or it ended (its lease is released)."""
        request_id = shaper.request_id
        finished = shaper.done is not None
        # A gateway that stops (SIGTERM) ends its streams, but their clients did not
        # leave: they may resume elsewhere, so their jobs run on.
        abort = abort_when_left and not AppStatus.should_exit
        if not finished and (not ended or shaper.error is not None):
            self.in_background(self.left(request_id, not abort)())
        else:
            self.in_background(self.quotas.release(request_id))

    async def _releasing(
        self, messages: AsyncGenerator[bytes, None], lease: str
    ) -> AsyncIterator[bytes]:
        try:
            async with aclosing(messages):
                async for message in messages:
                    yield message
        finally:
            self.in_background(self.quotas.release(lease))

    def left(self, request_id: str, resumable: bool) -> Callable[[], Awaitable[None]]:
        """What to do for a request whose client left before its end: abort it (not
        resumable, and the gateway aborts on disconnect), else keep its quota lease until it
        ends on its own."""

        async def left() -> None:
            wait = self.settings.event_timeout
            if not resumable and self.settings.abort_on_disconnect:
                log.info("client_left_aborting", request_id=request_id)
                with contextlib.suppress(ClientError):
                    await self.client.abort(request_id, timeout=1.0)
                # Only to settle its tokens: an aborted job ends within a second or so.
                wait = SETTLE_AFTER_ABORT_SECONDS if self.quotas.meter.is_open(request_id) else 0
            if wait:
                with contextlib.suppress(ClientError, ApiError):
                    end = await self.client.wait(request_id, timeout=wait)
                    await self.quotas.meter.settle(request_id, end)
            await self.quotas.release(request_id)

        return left

    async def until_disconnected(
        self,
        request: Request,
        work: Awaitable[T],
        on_left: Callable[[], Awaitable[None]] | None = None,
    ) -> T | None:
        """``work``'s result, or None when the client disconnects first (then ``on_left``
        runs in the background)."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.create_task(_disconnected(request))
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        watcher.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, ApiError):
            await task
        if on_left is not None:
            self.in_background(on_left())
        return None

    def in_background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def answer(shaper: Shaper) -> Response:
    """A finished request's answer in its API's shape: a completion, or a message (its
    error, raised, when it failed)."""
    if shaper.error is not None:
        raise shaper.error
    if shaper.shape.kind == "messages":
        headers = id_headers(shaper.request_id, anthropic=True)
        return JSONResponse(message_object(shaper), headers=headers)
    return JSONResponse(shaper.completion(), headers=id_headers(shaper.request_id, anthropic=False))


class Frames(Protocol):
    """A request's events as one API's SSE messages."""

    shaper: Shaper

    def opening(self) -> bytes:
        """The messages before any event's (seq 0's: a resumed stream has them)."""

    def feed(self, event: Event, after: int) -> bytes:
        """The messages ``event`` adds, if its seq is past ``after``."""

    def failed(self, error: ApiError) -> bytes:
        """The last message of a stream that failed."""


class ChunkFrames:
    """OpenAI's chat and completion chunks, ``data: [DONE]`` at the end."""

    def __init__(self, request_id: str, shape: ResponseShape) -> None:
        self.shaper = Shaper(request_id, shape)

    def opening(self) -> bytes:
        return sse_message(self.shaper.opening())

    def feed(self, event: Event, after: int) -> bytes:
        messages = [sse_message(c) for c in self.shaper.feed(event) if c.seq > after]
        if self.shaper.done is not None:
            messages.append(DONE_MESSAGE)
        return b"".join(messages)

    def failed(self, error: ApiError) -> bytes:
        return sse_data(error.body())


def frames_for(request_id: str, shape: ResponseShape) -> Frames:
    if shape.kind == "messages":
        return MessageFrames(request_id, shape)
    return ChunkFrames(request_id, shape)


class KeepAlive(ServerSentEvent):
    """A quiet stream's keep-alive: one comment line and no blank line after it. A blank line
    ends an event, and the openai SDK (which keeps the last ``id:``, as the SSE spec says)
    hands on that empty event and fails to parse it as JSON: a stream quiet for
    ``PING_SECONDS`` (a first token behind a long queue) broke every openai client."""

    def encode(self) -> bytes:
        return b": ping\r\n"


def event_stream(
    messages: AsyncIterator[bytes], request_id: str, *, anthropic: bool = False
) -> Response:
    """An SSE answer of ready-made messages, under the request's id; ``anthropic``: a
    Messages stream (its keep-alive a ``ping`` event, its id in ``request-id`` too)."""
    return EventSourceResponse(
        messages,
        ping=PING_SECONDS,
        ping_message_factory=AnthropicPing if anthropic else KeepAlive,
        headers={**id_headers(request_id, anthropic=anthropic), "cache-control": "no-cache"},
    )


def id_headers(request_id: str, *, anthropic: bool) -> dict[str, str]:
    """The headers that name an answer's request (Anthropic's SDKs read ``request-id``)."""
    if anthropic:
        return {"x-request-id": request_id, "request-id": request_id}
    return {"x-request-id": request_id}


def unavailable(exc: BaseException) -> ApiError:
    return ApiError(503, f"the queue is unavailable: {exc}", "server_error", code="unavailable")


def client_left() -> Response:
    """The answer to a client that left before it (nginx's 499: nobody reads it)."""
    return Response(status_code=499)


def _cancelled() -> bool:
    """Whether the running task is being cancelled (its client left: ``on_left`` then
    decides when the request's quota lease goes)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (ASGI ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
