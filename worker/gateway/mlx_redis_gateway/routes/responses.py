"""``POST /v1/responses``: OpenAI's Responses API, stateless (``responses_api``), over a chat
job."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_redis_gateway.errors import ApiError
from mlx_redis_gateway.gateway import Gateway, client_left, event_stream
from mlx_redis_gateway.responses_api import (
    ResponseEvents,
    completed_response,
    parse_responses_request,
)
from mlx_redis_gateway.shaping import Shaper

log = structlog.get_logger(__name__)


class ResponseRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def create(self, request: Request) -> Response:
        gateway = self.gateway
        key = gateway.auth.api_key(request)
        accepted, echoed = parse_responses_request(
            await gateway.json_body(request),
            limits=gateway.settings.limits,
            user_key=key.name if key is not None else None,
            counts=gateway.settings.counts,
        )
        await gateway.check_served(accepted.model)
        await gateway.check_media(accepted)
        request_id = accepted.request_id
        shape = await gateway.admit_and_submit(accepted, key)
        created = time.time()
        resumable = gateway.resumable(request, accepted)
        structlog.contextvars.bind_contextvars(request_id=request_id)
        log.info("gateway_request", kind="response", model=accepted.model, stream=accepted.stream)
        if accepted.stream:
            events = ResponseEvents(request_id, Shaper(request_id, shape), echoed, created)
            return event_stream(self._sse(events, abort_when_left=not resumable), request_id)
        shaper = await gateway.finished(request, request_id, shape, resumable=resumable)
        if shaper is None:
            return client_left()
        body = completed_response(shaper, echoed, created)
        return JSONResponse(body, headers={"x-request-id": request_id})

    async def _sse(self, events: ResponseEvents, *, abort_when_left: bool) -> AsyncIterator[bytes]:
        """A Responses stream: its opening events, one message per text delta, its closing
        events (or ``response.failed``)."""
        shaper, ended = events.shaper, False
        try:
            yield events.opening()
            try:
                async for event in self.gateway.events(shaper.request_id):
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
            self.gateway.stream_ended(shaper, ended=ended, abort_when_left=abort_when_left)
