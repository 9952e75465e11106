"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one job per request, or one
per choice when it asks for several (``n`` > 1, a list of prompts; ``fanout``)."""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from sse_starlette.sse import AppStatus
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_redis_gateway.api_keys import ApiKey
from mlx_redis_gateway.errors import ApiError
from mlx_redis_gateway.fanout import (
    Choice,
    child_shape,
    merged_completion,
    merged_stream,
    queue_choices,
)
from mlx_redis_gateway.gateway import Gateway, client_left, event_stream, unavailable
from mlx_redis_gateway.openai_api import CompletionRequest, Kind, parse_request
from mlx_redis_gateway.shaping import Shaper
from mlx_redis_gateway.token_meter import prompt_token_bound
from mlx_redis_protocol.connection import is_unavailable
from mlx_redis_protocol.errors import ClientError, RedisUnavailable
from mlx_redis_protocol.messages import Job

log = structlog.get_logger(__name__)


class CompletionRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def text(self, request: Request) -> Response:
        return await self._complete(request, "text")

    async def _complete(self, request: Request, kind: Kind) -> Response:
        gateway = self.gateway
        key = gateway.auth.api_key(request)
        async with gateway.screening(key):
            accepted = parse_request(
                kind,
                await gateway.json_body(request),
                limits=gateway.settings.limits,
                user_key=key.name if key is not None else None,
                counts=gateway.settings.counts,
            )
            await gateway.check_served(accepted.model)
            await gateway.check_media(accepted)
        if accepted.choices:
            return await self._fan_out(request, accepted, key)
        return await gateway.serve(request, accepted, key)

    async def _fan_out(
        self, request: Request, accepted: CompletionRequest, key: ApiKey | None
    ) -> Response:
        """A request of several choices (``n`` > 1, a list of prompts), each a job of its own
        (``fanout`` says how they are queued and merged)."""
        gateway = self.gateway
        request_id = accepted.request_id
        shape = gateway.shape(accepted, key)
        choices = [
            Choice(c.index, c.job.request_id, child_shape(shape), c.leads) for c in accepted.choices
        ]
        queued = {c.request_id: asyncio.Event() for c in choices}
        if key is not None:
            await self._admit_all(key, [c.job for c in accepted.choices])
        try:
            accepted = await gateway.with_media(accepted)
        except BaseException:
            await self._release_all([c.request_id for c in choices], withdraw=True)
            raise

        async def submit(job: Job) -> None:
            await gateway.queue(job, shape)
            queued[job.request_id].set()

        leaders_queued = asyncio.Event()
        queuing = asyncio.ensure_future(
            queue_choices(accepted.choices, submit, gateway.events, leaders_queued=leaders_queued)
        )
        queuing.add_done_callback(_log_queuing_failure)
        # The leading jobs are queued before the answer starts: a refusal is its status.
        leaders = asyncio.ensure_future(leaders_queued.wait())
        await asyncio.wait({leaders, queuing}, return_when=asyncio.FIRST_COMPLETED)
        leaders.cancel()
        if queuing.done() and queuing.exception() is not None:
            await self._release_all([c for c in queued if queued[c].is_set()])
            await self._release_all([c for c in queued if not queued[c].is_set()], withdraw=True)
            raise _as_api_error(queuing.exception())
        structlog.contextvars.bind_contextvars(request_id=request_id)
        log.info("gateway_request", kind=accepted.kind, model=accepted.model, choices=len(choices))
        resumable = gateway.resumable(request, accepted)

        async def queued_choice(choice: Choice) -> None:
            waiter = asyncio.ensure_future(queued[choice.request_id].wait())
            await asyncio.wait({waiter, queuing}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if not queued[choice.request_id].is_set():
                raise _as_api_error(queuing.exception())

        def left(unfinished: list[str]) -> None:
            queuing.cancel()
            jobs = [c.request_id for c in choices]
            gateway.in_background(self._fan_out_left(request_id, jobs, unfinished, resumable))

        if accepted.stream:
            messages = merged_stream(
                request_id,
                choices,
                gateway.events,
                include_usage=accepted.include_usage,
                queued=queued_choice,
                left=left,
            )
            return event_stream(messages, request_id)

        async def follow(choice: Choice) -> Shaper:
            await queued_choice(choice)
            return await gateway.follow(choice.request_id, choice.shape, holds_lease=False)

        async def answers() -> list[Shaper]:
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
                unfinished = [c.request_id for c in choices if c.request_id not in finished]
                if unfinished or _cancelled():
                    left(unfinished)

        shapers = await gateway.until_disconnected(request, answers())
        if shapers is None:
            return client_left()
        # Every choice ended: their leases go back before the answer leaves, as a request of
        # one job's do, so the client's next request finds its key's slots free (released in
        # the background, they were still held when a quick client came back: a 429).
        if all(shaper.done is not None for shaper in shapers):
            queuing.cancel()
            await self._release_all([c.request_id for c in choices])
        body = merged_completion(request_id, choices, shapers)
        return JSONResponse(body, headers={"x-request-id": request_id})

    async def _fan_out_left(
        self, request_id: str, jobs: list[str], unfinished: list[str], resumable: bool
    ) -> None:
        """A fanned-out request is over for its client: its jobs that have not ended are
        aborted (unless it was resumable, or the gateway is stopping), their leases released."""
        gateway = self.gateway
        abort = gateway.settings.abort_on_disconnect and not AppStatus.should_exit
        if unfinished and not resumable and abort:
            log.info("fan_out_left_aborting", request_id=request_id, jobs=len(unfinished))
            for job_id in unfinished:
                with contextlib.suppress(ClientError):
                    await gateway.client.abort(job_id, timeout=1.0)
        await self._release_all(jobs)

    async def _admit_all(self, key: ApiKey, jobs: list[Job]) -> None:
        """Each job of a fanned-out request counts against its key's limits (its prompt's
        tokens too), as a request of its own would; refused (429) unless all are admitted."""
        admitted: list[str] = []
        try:
            for job in jobs:
                tokens = prompt_token_bound(job)
                await self.gateway.quotas.admit_or_refuse(key, job.request_id, tokens=tokens)
                admitted.append(job.request_id)
        except BaseException:
            await self._release_all(admitted, withdraw=True)
            raise

    async def _release_all(self, request_ids: list[str], *, withdraw: bool = False) -> None:
        """Give the jobs' leases back (``withdraw``: and their tokens, never queued)."""
        quotas = self.gateway.quotas
        for request_id in request_ids:
            await (quotas.withdraw if withdraw else quotas.release)(request_id)


def _cancelled() -> bool:
    """Whether the running task is being cancelled (its client left)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


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
        return unavailable(exc)
    return ApiError(500, f"the request's jobs could not be queued: {exc}", "server_error")
