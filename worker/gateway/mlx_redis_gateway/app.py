"""The OpenAI-compatible gateway: HTTP requests in, jobs on the queue, answers from the log.

A gateway holds no state but Redis: each request becomes a job (``mlx_redis_protocol.client``), its
answer is read from the request's replay log, and what another gateway needs to stream it
again (the answer's shape and owner) is a key beside the log. So any number of gateways can
stand behind a load balancer, and a client that lost its stream resumes it on any of them with
``GET /v1/requests/{id}/stream`` and ``Last-Event-ID``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``
(streamed as SSE or one JSON body), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /v1/requests/{id}`` (the finished answer), ``GET /v1/requests/{id}/stream``,
``GET /health``, and the status page (``/``, ``/status.json``, ``/status/fragment``). Any
other path or method is a 404 or 405 in OpenAI's error shape, as every other refusal is.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import structlog
from redis.exceptions import RedisError
from sse_starlette import EventSourceResponse
from sse_starlette.sse import AppStatus
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from mlx_redis_gateway.api_keys import ApiKey, KeyFile
from mlx_redis_gateway.auth import Authenticator
from mlx_redis_gateway.browser_guard import BrowserGuard, require_json
from mlx_redis_gateway.errors import ApiError
from mlx_redis_gateway.fanout import (
    Choice,
    child_shape,
    merged_completion,
    merged_stream,
    queue_choices,
)
from mlx_redis_gateway.fleet_status import FleetStatus, read_fleet_status
from mlx_redis_gateway.http_limits import DEFAULT_HTTP_LIMITS, HttpLimits, RequestLimits, read_json
from mlx_redis_gateway.openai_api import CompletionRequest, Kind, check_request_id, parse_request
from mlx_redis_gateway.quotas import LEASE_SECONDS, Quotas, read_lease
from mlx_redis_gateway.redis_health import HealthProbe
from mlx_redis_gateway.responses_api import (
    ResponseEvents,
    completed_response,
    parse_responses_request,
)
from mlx_redis_gateway.shaping import DONE_MESSAGE, ResponseShape, Shaper, sse_data, sse_message
from mlx_redis_gateway.status_page import STATUS_PAGE_CSP, render_fragment, render_page
from mlx_redis_protocol.client import Client
from mlx_redis_protocol.connection import is_unavailable
from mlx_redis_protocol.constants import DEFAULT_LOG_TTL_SECONDS, DEFAULT_PREFIX, DEFAULT_REDIS_URL
from mlx_redis_protocol.errors import (
    ClientError,
    RedisUnavailable,
    RequestNotFound,
    StreamRewritten,
    StreamTimeout,
)
from mlx_redis_protocol.limits import DEFAULT_LIMITS, Limits
from mlx_redis_protocol.messages import Event, Job
from mlx_redis_protocol.redis_retry import describe
from mlx_redis_protocol.supervisor import supervise

log = structlog.get_logger(__name__)
T = TypeVar("T")

# The header (or body field ``resumable``) by which a client says its stream may be resumed:
# its disconnect then leaves the job running instead of aborting it.
RESUMABLE_HEADER: Final = "x-resumable"
# How long one read of the fleet's status serves the status page's requests.
STATUS_CACHE_SECONDS: Final = 1.0
_PAGE_HEADERS: Final = {"content-security-policy": STATUS_PAGE_CSP}


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    redis_url: str = DEFAULT_REDIS_URL
    redis_topology: str = "auto"
    prefix: str = DEFAULT_PREFIX
    api_keys: Path | None = None  # None: no authentication
    # A client that disconnects from a request it did not mark resumable aborts its job.
    abort_on_disconnect: bool = True
    # Requests are resumable unless they say otherwise (their disconnect never aborts).
    resumable_by_default: bool = False
    # Longest wait for a request's next event before the gateway gives up on it.
    event_timeout: float = 600.0
    log_ttl: int = DEFAULT_LOG_TTL_SECONDS
    status_page: bool = True
    # How long a request's concurrency slot outlives a gateway that stopped refreshing it.
    quota_lease_seconds: float = LEASE_SECONDS
    limits: Limits = DEFAULT_LIMITS
    http: HttpLimits = DEFAULT_HTTP_LIMITS
    # Host names answered besides the loopback ones ("*": any); checked without API keys,
    # or with them when any is named.
    allowed_hosts: tuple[str, ...] = ()

    def checked_hosts(self) -> tuple[str, ...] | None:
        """The Host allowlist to enforce; None: any Host."""
        if self.api_keys is not None and not self.allowed_hosts:
            return None
        return self.allowed_hosts

    def __post_init__(self) -> None:
        if self.quota_lease_seconds < 1:
            raise ValueError(
                f"--quota-lease-seconds must be at least 1, got {self.quota_lease_seconds}"
            )


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
        )
        self.keys = KeyFile(settings.api_keys) if settings.api_keys is not None else None
        self.auth = Authenticator(self.keys)
        self._quotas: Quotas | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._status: tuple[float, FleetStatus] | None = None
        self._status_lock = asyncio.Lock()
        self._health = HealthProbe(self.client)

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
            for task in list(self._background):
                task.cancel()
            await asyncio.gather(leases, *self._background, return_exceptions=True)
            await self.quotas.close()
            await self.client.aclose()

    # -- routes ------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "text")

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, stateless (``responses_api``), over a chat job."""
        key = self.auth.api_key(request)
        accepted, echoed = parse_responses_request(
            await self._json_body(request),
            limits=self.settings.limits,
            user_key=key.name if key is not None else None,
        )
        await self._check_served(accepted.model)
        request_id = accepted.request_id
        if key is not None:
            await self.quotas.admit_or_refuse(key, request_id)
        try:
            shape = await self._submit(accepted, key)
        except BaseException:
            await self.quotas.release(request_id)
            raise
        created = time.time()
        resumable = self._resumable(request, accepted)
        structlog.contextvars.bind_contextvars(request_id=request_id)
        log.info("gateway_request", kind="response", model=accepted.model, stream=accepted.stream)
        if accepted.stream:
            events = ResponseEvents(request_id, Shaper(request_id, shape), echoed, created)
            return EventSourceResponse(
                self._response_sse(events, abort_when_left=not resumable),
                ping=15,
                headers={"x-request-id": request_id, "cache-control": "no-cache"},
            )
        shaper = await self._until_disconnected(
            request, self._follow(request_id, shape), on_left=self._left(request_id, resumable)
        )
        if shaper is None:
            return Response(status_code=499)
        body = completed_response(shaper, echoed, created)
        return JSONResponse(body, headers={"x-request-id": request_id})

    async def models(self, request: Request) -> Response:
        self.auth.api_key(request)
        served = await self.client.served_models()
        data = [_model_object(name) for name in sorted(served)]
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        """One served model (``client.models.retrieve``); 404 ``model_not_found`` otherwise."""
        self.auth.api_key(request)
        name = request.path_params["model"]
        await self._check_served(name)
        return JSONResponse(_model_object(name))

    async def health(self, request: Request) -> Response:
        """200 while Redis answers, 503 only when it cannot be reached; how busy the
        gateway's Redis commands are is told beside (``redis.saturated``), not as a failure."""
        load = self.client.command_load()
        try:
            served = await self._health.served_models()
        except RedisUnavailable as exc:
            return JSONResponse({"status": "unavailable", "error": str(exc)}, status_code=503)
        return JSONResponse(
            {
                "status": "ok",
                "models": sorted(served),
                "redis": {
                    "saturated": load.saturated,
                    "commands_in_flight": load.in_flight,
                    "commands_waiting": load.waiting,
                    "max_in_flight": load.max_in_flight,
                },
            }
        )

    async def resume(self, request: Request) -> Response:
        """The request's stream again, after the event the client names (``Last-Event-ID``
        header or ``last_event_id`` query parameter); from the start without one."""
        key = self.auth.api_key(request)
        raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
        try:
            after = int(raw) if raw is not None else -1
        except ValueError as exc:
            raise ApiError(400, "Last-Event-ID must be an integer", param="Last-Event-ID") from exc
        lease = await self._admit_read(request, key)
        try:
            request_id, shape = await self._owned(request, key)
        except BaseException:
            await self._release(lease)
            raise
        return self._stream_response(
            request_id, shape, after=after, abort_when_left=False, lease=lease
        )

    async def result(self, request: Request) -> Response:
        """The finished answer of a request (waits for its end), as a completion object."""
        key = self.auth.api_key(request)
        lease = await self._admit_read(request, key)
        try:
            request_id, shape = await self._owned(request, key)
            # Another route may be streaming this request: its lease is not this route's.
            following = self._follow(request_id, shape, holds_lease=False)
            shaper = await self._until_disconnected(request, following)
        finally:
            await self._release(lease)
        if shaper is None:
            return Response(status_code=499)
        return self._answer(shaper)

    async def status_page(self, request: Request) -> Response:
        self.auth.operator(request)
        return HTMLResponse(render_page(await self._fleet_status()), headers=_PAGE_HEADERS)

    async def status_fragment(self, request: Request) -> Response:
        self.auth.operator(request)
        return HTMLResponse(render_fragment(await self._fleet_status()), headers=_PAGE_HEADERS)

    async def status_json(self, request: Request) -> Response:
        self.auth.operator(request)
        return JSONResponse((await self._fleet_status()).as_dict())

    # -- completions -------------------------------------------------------------------------

    async def _complete(self, request: Request, kind: Kind) -> Response:
        key = self.auth.api_key(request)
        accepted = parse_request(
            kind,
            await self._json_body(request),
            limits=self.settings.limits,
            user_key=key.name if key is not None else None,
        )
        await self._check_served(accepted.model)
        if accepted.choices:
            return await self._fan_out(request, accepted, key)
        request_id = accepted.request_id
        if key is not None:
            await self.quotas.admit_or_refuse(key, request_id)
        try:
            shape = await self._submit(accepted, key)
        except BaseException:
            await self.quotas.release(request_id)
            raise
        resumable = self._resumable(request, accepted)
        structlog.contextvars.bind_contextvars(request_id=request_id)
        log.info("gateway_request", kind=kind, model=accepted.model, stream=accepted.stream)
        if accepted.stream:
            return self._stream_response(request_id, shape, after=-1, abort_when_left=not resumable)
        shaper = await self._until_disconnected(
            request, self._follow(request_id, shape), on_left=self._left(request_id, resumable)
        )
        if shaper is None:
            return Response(status_code=499)
        return self._answer(shaper)

    async def _json_body(self, request: Request) -> Any:
        require_json(request)
        return read_json(await request.body(), self.settings.http.max_json_depth)

    async def _check_served(self, model: str) -> None:
        if not await self.client.serves(model):
            raise ApiError(
                404,
                f"the model {model!r} does not exist or no live worker serves it",
                param="model",
                code="model_not_found",
            )

    async def _submit(self, accepted: CompletionRequest, key: ApiKey | None) -> ResponseShape:
        shape = self._shape(accepted, key)
        await self._queue(accepted.job, shape)
        return shape

    def _shape(self, accepted: CompletionRequest, key: ApiKey | None) -> ResponseShape:
        return ResponseShape(
            kind=accepted.kind,
            model=accepted.model,
            created=int(time.time()),
            include_usage=accepted.include_usage,
            logprobs=accepted.logprobs,
            owner=key.name if key is not None else None,
        )

    async def _queue(self, job: Job, shape: ResponseShape) -> None:
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
                raise ApiError(
                    503, f"the queue is unavailable: {exc}", "server_error", code="unavailable"
                ) from exc
            raise

    async def _fan_out(
        self, request: Request, accepted: CompletionRequest, key: ApiKey | None
    ) -> Response:
        """A request of several choices (``n`` > 1, a list of prompts), each a job of its own
        (``fanout`` says how they are queued and merged)."""
        request_id = accepted.request_id
        shape = self._shape(accepted, key)
        choices = [
            Choice(c.index, c.job.request_id, child_shape(shape), c.leads) for c in accepted.choices
        ]
        queued = {c.request_id: asyncio.Event() for c in choices}
        if key is not None:
            await self._admit_all(key, [c.request_id for c in choices])

        async def submit(job: Job) -> None:
            await self._queue(job, shape)
            queued[job.request_id].set()

        leaders_queued = asyncio.Event()
        queuing = asyncio.ensure_future(
            queue_choices(accepted.choices, submit, self._events, leaders_queued=leaders_queued)
        )
        queuing.add_done_callback(_log_queuing_failure)
        # The leading jobs are queued before the answer starts: a refusal is its status.
        leaders = asyncio.ensure_future(leaders_queued.wait())
        await asyncio.wait({leaders, queuing}, return_when=asyncio.FIRST_COMPLETED)
        leaders.cancel()
        if queuing.done() and queuing.exception() is not None:
            await self._release_all([c.request_id for c in choices])
            raise _as_api_error(queuing.exception())
        structlog.contextvars.bind_contextvars(request_id=request_id)
        log.info("gateway_request", kind=accepted.kind, model=accepted.model, choices=len(choices))
        resumable = self._resumable(request, accepted)

        async def queued_choice(choice: Choice) -> None:
            waiter = asyncio.ensure_future(queued[choice.request_id].wait())
            await asyncio.wait({waiter, queuing}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if not queued[choice.request_id].is_set():
                raise _as_api_error(queuing.exception())

        def left(unfinished: list[str]) -> None:
            queuing.cancel()
            jobs = [c.request_id for c in choices]
            self._in_background(self._fan_out_left(request_id, jobs, unfinished, resumable))

        if accepted.stream:
            messages = merged_stream(
                request_id,
                choices,
                self._events,
                include_usage=accepted.include_usage,
                queued=queued_choice,
                left=left,
            )
            return EventSourceResponse(
                messages, ping=15, headers={"x-request-id": request_id, "cache-control": "no-cache"}
            )

        async def follow(choice: Choice) -> Shaper:
            await queued_choice(choice)
            return await self._follow(choice.request_id, choice.shape, holds_lease=False)

        async def answer() -> list[Shaper]:
            following = [asyncio.ensure_future(follow(choice)) for choice in choices]
            try:
                return list(await asyncio.gather(*following))
            finally:
                for task in following:
                    task.cancel()
                ended = [
                    t for t in following if t.done() and not t.cancelled() and not t.exception()
                ]
                finished = {t.result().request_id for t in ended if t.result().done is not None}
                left([c.request_id for c in choices if c.request_id not in finished])

        shapers = await self._until_disconnected(request, answer())
        if shapers is None:
            return Response(status_code=499)
        body = merged_completion(request_id, choices, shapers)
        return JSONResponse(body, headers={"x-request-id": request_id})

    async def _fan_out_left(
        self, request_id: str, jobs: list[str], unfinished: list[str], resumable: bool
    ) -> None:
        """A fanned-out request is over for its client: its jobs that have not ended are
        aborted (unless it was resumable, or the gateway is stopping), their leases released."""
        abort = self.settings.abort_on_disconnect and not AppStatus.should_exit
        if unfinished and not resumable and abort:
            log.info("fan_out_left_aborting", request_id=request_id, jobs=len(unfinished))
            for job_id in unfinished:
                with contextlib.suppress(ClientError):
                    await self.client.abort(job_id, timeout=1.0)
        await self._release_all(jobs)

    async def _admit_all(self, key: ApiKey, request_ids: list[str]) -> None:
        """Each job of a fanned-out request counts against its key's limits, as a request of
        its own would; refused (429) unless all are admitted."""
        admitted: list[str] = []
        try:
            for request_id in request_ids:
                await self.quotas.admit_or_refuse(key, request_id)
                admitted.append(request_id)
        except BaseException:
            await self._release_all(admitted)
            raise

    async def _release_all(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            await self.quotas.release(request_id)

    def _resumable(self, request: Request, accepted: CompletionRequest) -> bool:
        header = request.headers.get(RESUMABLE_HEADER)
        if header is not None:
            return header.strip().lower() in ("1", "true", "yes", "on")
        if accepted.resumable is not None:
            return accepted.resumable
        return self.settings.resumable_by_default

    def _answer(self, shaper: Shaper) -> Response:
        if shaper.error is not None:
            raise shaper.error
        return JSONResponse(shaper.completion(), headers={"x-request-id": shaper.request_id})

    # -- following a request -----------------------------------------------------------------

    async def _events(self, request_id: str) -> AsyncIterator[Event]:
        """The request's events; a failure to follow it ends as an ApiError."""
        events = self.client.stream(request_id, timeout=self.settings.event_timeout)
        try:
            async with aclosing(events):
                async for event in events:
                    yield event
        except RequestNotFound as exc:
            raise ApiError(404, str(exc), code="request_not_found") from exc
        except StreamTimeout as exc:
            raise ApiError(504, str(exc), "server_error", code="timeout") from exc
        except StreamRewritten as exc:
            raise ApiError(500, str(exc), "server_error", code="stream_rewritten") from exc
        except RedisUnavailable as exc:
            raise ApiError(503, str(exc), "server_error", code="unavailable") from exc

    async def _follow(
        self, request_id: str, shape: ResponseShape, *, holds_lease: bool = True
    ) -> Shaper:
        """Follow a request to its end; the shaper holds the answer (or its error). Nothing
        was sent yet, so history rewritten under us (a failover) is followed again."""
        try:
            while True:
                shaper = Shaper(request_id, shape, streaming=False)
                try:
                    async for event in self._events(request_id):
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

    def _stream_response(
        self,
        request_id: str,
        shape: ResponseShape,
        *,
        after: int,
        abort_when_left: bool,
        lease: str | None = None,
    ) -> Response:
        """``lease``: a read's quota lease, given back when the stream ends."""
        messages = self._sse(request_id, shape, after, abort_when_left)
        return EventSourceResponse(
            messages if lease is None else self._releasing(messages, lease),
            ping=15,
            headers={"x-request-id": request_id, "cache-control": "no-cache"},
        )

    async def _sse(
        self, request_id: str, shape: ResponseShape, after: int, abort_when_left: bool
    ) -> AsyncGenerator[bytes, None]:
        """The SSE messages of a request, after seq ``after``: its chunks, then ``[DONE]``
        (or an error chunk). A client that leaves first aborts the job when
        ``abort_when_left`` (and the gateway is configured to)."""
        shaper = Shaper(request_id, shape)
        ended = False
        try:
            if after < 0:
                yield sse_message(shaper.opening())
            try:
                async for event in self._events(request_id):
                    # An event's chunks (and the end) leave in one write.
                    messages = [sse_message(c) for c in shaper.feed(event) if c.seq > after]
                    if shaper.done is not None:
                        messages.append(DONE_MESSAGE)
                    if messages:
                        yield b"".join(messages)
                    if shaper.finished:
                        break
            except ApiError as error:
                shaper.error = error
                yield sse_data(error.body())
            ended = True
        finally:
            self._stream_ended(shaper, ended=ended, abort_when_left=abort_when_left)

    async def _response_sse(
        self, events: ResponseEvents, *, abort_when_left: bool
    ) -> AsyncIterator[bytes]:
        """A Responses stream: its opening events, one message per text delta, its closing
        events (or ``response.failed``)."""
        shaper, ended = events.shaper, False
        try:
            yield events.opening()
            try:
                async for event in self._events(shaper.request_id):
                    messages = events.feed(event)
                    if messages:
                        yield messages
                    if shaper.finished:
                        break
            except ApiError as error:
                shaper.error = error
                yield events.failed(error)
            ended = True
        finally:
            self._stream_ended(shaper, ended=ended, abort_when_left=abort_when_left)

    def _stream_ended(self, shaper: Shaper, *, ended: bool, abort_when_left: bool) -> None:
        """A stream is over: its request's client left before its end (then the job is
        aborted, or kept for a resume), or it ended (its lease is released)."""
        request_id = shaper.request_id
        finished = shaper.done is not None
        # A gateway that stops (SIGTERM) ends its streams, but their clients did not
        # leave: they may resume elsewhere, so their jobs run on.
        abort = abort_when_left and not AppStatus.should_exit
        if not finished and (not ended or shaper.error is not None):
            self._in_background(self._left(request_id, not abort)())
        else:
            self._in_background(self.quotas.release(request_id))

    async def _releasing(
        self, messages: AsyncGenerator[bytes, None], lease: str
    ) -> AsyncIterator[bytes]:
        try:
            async with aclosing(messages):
                async for message in messages:
                    yield message
        finally:
            self._in_background(self.quotas.release(lease))

    def _left(self, request_id: str, resumable: bool) -> Callable[[], Awaitable[None]]:
        """What to do for a request whose client left before its end: abort it (not
        resumable, and the gateway aborts on disconnect), else keep its quota lease until it
        ends on its own."""

        async def left() -> None:
            if not resumable and self.settings.abort_on_disconnect:
                log.info("client_left_aborting", request_id=request_id)
                with contextlib.suppress(ClientError):
                    await self.client.abort(request_id, timeout=1.0)
            else:
                with contextlib.suppress(ClientError, ApiError):
                    await self.client.wait(request_id, timeout=self.settings.event_timeout)
            await self.quotas.release(request_id)

        return left

    async def _until_disconnected(
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
            self._in_background(on_left())
        return None

    def _in_background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _owned(self, request: Request, key: ApiKey | None) -> tuple[str, ResponseShape]:
        """The request named in the path and its shape, if the caller's key made it."""
        request_id = check_request_id(request.path_params["request_id"])
        async with self.client.command_slot() as redis:
            raw = await redis.get(self.client.keys.gateway_request(request_id))
        shape = ResponseShape.decode(raw) if raw is not None else None
        # Someone else's request reads as missing: its existence is not told.
        if shape is None or (key is not None and shape.owner != key.name):
            raise ApiError(
                404, f"no request {request_id!r} (unknown, or expired)", code="request_not_found"
            )
        return request_id, shape

    async def _admit_read(self, request: Request, key: ApiKey | None) -> str | None:
        """A quota lease for reading the request named in the path (None without keys): a
        read counts against its key's rate and concurrency like a completion."""
        if key is None:
            return None
        request_id = check_request_id(request.path_params["request_id"])
        lease = read_lease(request_id)
        await self.quotas.admit_or_refuse(key, lease, holder=request_id)
        return lease

    async def _release(self, lease: str | None) -> None:
        if lease is not None:
            await self.quotas.release(lease)

    # -- status ------------------------------------------------------------------------------

    async def _fleet_status(self) -> FleetStatus:
        async with self._status_lock:
            now = time.monotonic()
            if self._status is None or now - self._status[0] > STATUS_CACHE_SECONDS:
                async with self.client.command_slot() as redis:
                    self._status = (now, await read_fleet_status(redis, self.client.keys))
            return self._status[1]


def _log_queuing_failure(task: asyncio.Future[None]) -> None:
    """A fan-out's jobs that could not all be queued: its client hears of it from the
    choices left waiting; the operator from this line (even when no client is left)."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("fan_out_queuing_failed", error=str(task.exception()))


def _as_api_error(exc: BaseException | None) -> ApiError:
    """What a client is told when its request's jobs could not all be queued."""
    if isinstance(exc, ApiError):
        return exc
    if exc is not None and (isinstance(exc, RedisUnavailable) or is_unavailable(exc)):
        return ApiError(503, f"the queue is unavailable: {exc}", "server_error", code="unavailable")
    return ApiError(500, f"the request's jobs could not be queued: {exc}", "server_error")


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


def _model_object(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "mlx-redis-worker"}


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, a method the route does not take) in OpenAI's
    error shape, so a client's error handling sees one format for every answer."""
    assert isinstance(exc, HTTPException)
    method, path = request.method, request.url.path
    if exc.status_code == 404:
        error = ApiError(404, f"Invalid URL ({method} {path})", code="not_found")
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"Method {method} is not allowed for {path} (allowed: {allowed})"
        error = ApiError(405, message, code="method_not_allowed")
    else:
        error = ApiError(exc.status_code, exc.detail, code=None)
    headers = {**(exc.headers or {}), **error.headers()}
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


async def _unavailable(request: Request, exc: Exception) -> Response:
    error = ApiError(503, f"the queue is unavailable: {exc}", "server_error", code="unavailable")
    return await _api_error(request, error)


async def _redis_error(request: Request, exc: Exception) -> Response:
    """Redis said no to a command (an ACL changed under a running gateway, a full Redis): the
    client gets a typed 503, the operator the server's words in the log."""
    if is_unavailable(exc):
        return await _unavailable(request, exc)
    log.error("redis_refused", path=request.url.path, error=describe(exc))
    message = "the queue refused a command the gateway needs; its log says which"
    return await _api_error(request, ApiError(503, message, "server_error", code="redis_refused"))


def build_app(settings: GatewaySettings) -> Starlette:
    gateway = Gateway(settings)
    routes = [
        Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/responses", gateway.responses, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/v1/models/{model:path}", gateway.model, methods=["GET"]),
        Route("/v1/requests/{request_id}", gateway.result, methods=["GET"]),
        Route("/v1/requests/{request_id}/stream", gateway.resume, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
    ]
    if settings.status_page:
        routes += [
            Route("/", gateway.status_page, methods=["GET"]),
            Route("/status.json", gateway.status_json, methods=["GET"]),
            Route("/status/fragment", gateway.status_fragment, methods=["GET"]),
        ]
    handlers: Mapping[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        ApiError: _api_error,
        HTTPException: _http_error,
        RedisUnavailable: _unavailable,
        RedisError: _redis_error,
    }
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(RequestLimits, limits=settings.http),
            Middleware(BrowserGuard, allowed_hosts=settings.checked_hosts()),
        ],
        exception_handlers=handlers,
        lifespan=gateway.lifespan,
    )
    app.state.gateway = gateway
    return app
