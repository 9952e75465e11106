"""``POST /v1/responses`` (``responses_api``, over a chat job), and the stored responses
(``response_store``): ``GET /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``,
``DELETE /v1/responses/{id}``, each within the caller's API key (another key's response is
a 404, as one never stored)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Final

import structlog
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_redis_gateway.api_keys import ApiKey
from mlx_redis_gateway.errors import ApiError, bad_request
from mlx_redis_gateway.gateway import Gateway, client_left, event_stream
from mlx_redis_gateway.response_store import (
    ANONYMOUS,
    ResponseStore,
    StoredResponse,
    encoded_size,
)
from mlx_redis_gateway.responses_api import (
    ResponseEvents,
    ResponsesRequest,
    completed_response,
    is_response_id,
    parse_responses_request,
    previous_not_found,
    previous_response_id,
)
from mlx_redis_gateway.shaping import Shaper
from mlx_redis_protocol.errors import RedisUnavailable
from mlx_redis_protocol.redis_retry import describe

log = structlog.get_logger(__name__)

# ``input_items``' page size: OpenAI's default and bounds.
DEFAULT_PAGE: Final = 20
MAX_PAGE: Final = 100


class ResponseRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.store = ResponseStore(
            gateway.client.command_slot, gateway.client.keys, gateway.settings.store
        )

    async def create(self, request: Request) -> Response:
        gateway = self.gateway
        key = gateway.auth.api_key(request)
        context: list[dict[str, Any]] = []
        async with gateway.screening(key):
            body = await gateway.json_body(request)
            previous = previous_response_id(body)
            if previous is not None:
                stored = await self._stored(key, previous) if is_response_id(previous) else None
                if stored is None:
                    raise previous_not_found(previous)
                context = stored.conversation()
            parsed = parse_responses_request(
                body,
                limits=gateway.settings.limits,
                user_key=key.name if key is not None else None,
                context=context,
                counts=gateway.settings.counts,
            )
            self._check_storable(parsed, context)
            accepted, echoed = parsed.accepted, parsed.echoed
            await gateway.check_served(accepted.model)
            await gateway.check_media(accepted)
        # Said from the first event on: a gateway that keeps nothing never claims it will.
        echoed["store"] = parsed.store and gateway.settings.store.enabled
        request_id = accepted.request_id
        shape = await gateway.admit_and_submit(accepted, key)
        created = time.time()
        resumable = gateway.resumable(request, accepted)
        structlog.contextvars.bind_contextvars(request_id=request_id)
        log.info("gateway_request", kind="response", model=accepted.model, stream=accepted.stream)
        if accepted.stream:
            shaper = Shaper(request_id, shape)
            events = ResponseEvents(request_id, shaper, echoed, created, hold_final=True)
            messages = self._sse(events, key, parsed, context, abort_when_left=not resumable)
            return event_stream(messages, request_id)
        finished = await gateway.finished(request, request_id, shape, resumable=resumable)
        if finished is None:
            return client_left()
        response = completed_response(finished, echoed, created)
        await self._keep(key, parsed, context, response)
        return JSONResponse(response, headers={"x-request-id": request_id})

    def _check_storable(self, parsed: ResponsesRequest, context: list[dict[str, Any]]) -> None:
        """A conversation too big to store is refused before it runs, rather than answered
        and then not kept (its next turn would find nothing)."""
        limits = self.gateway.settings.store
        if not (parsed.store and limits.enabled):
            return
        size = encoded_size([*context, *parsed.input_items])
        if size > limits.max_response_bytes:
            raise bad_request(
                f"this conversation takes {size} bytes, more than the "
                f"{limits.max_response_bytes} a stored response may hold: send store: false "
                "(and the whole conversation as input), or start a new one",
                param="input",
                code="conversation_too_large",
            )

    async def _keep(
        self,
        key: ApiKey | None,
        parsed: ResponsesRequest,
        context: list[dict[str, Any]],
        response: dict[str, Any],
    ) -> None:
        """Store a finished response (``store: true``); its ``store`` says whether it was."""
        if not parsed.store:
            return
        stored = StoredResponse(response, context, parsed.input_items)
        try:
            response["store"] = await self.store.save(_scope(key), stored)
        except (RedisError, RedisUnavailable) as exc:
            # The answer is made: it goes out, saying it was not kept.
            log.error("response_store_failed", response_id=response["id"], error=describe(exc))
            response["store"] = False

    async def _sse(
        self,
        events: ResponseEvents,
        key: ApiKey | None,
        parsed: ResponsesRequest,
        context: list[dict[str, Any]],
        *,
        abort_when_left: bool,
    ) -> AsyncIterator[bytes]:
        """A Responses stream: its opening events, one message per text delta, its closing
        events (the last once the response is stored), or ``response.failed``."""
        shaper, ended = events.shaper, False
        try:
            yield events.opening()
            try:
                async for event in self.gateway.events(shaper.request_id):
                    messages = events.feed(event)
                    if messages:
                        yield messages
                    if events.final is not None:
                        await self._keep(key, parsed, context, events.final)
                        yield events.final_message()
                        break
                    if shaper.finished:
                        break
            except ApiError as error:
                shaper.error = error
                yield events.failed(error)
            ended = True
        finally:
            self.gateway.stream_ended(shaper, ended=ended, abort_when_left=abort_when_left)

    # -- stored responses ----------------------------------------------------------------------

    async def retrieve(self, request: Request) -> Response:
        key, response_id = self._named(request)
        async with self.gateway.reading(key, response_id):
            stored = await self._found(key, response_id)
        return JSONResponse(stored.response)

    async def input_items(self, request: Request) -> Response:
        """The response's input items, a page at a time (``limit``, ``order``, and ``after``
        or ``before`` an item's id), in OpenAI's list shape."""
        key, response_id = self._named(request)
        limit, descending = _page(request)
        async with self.gateway.reading(key, response_id):
            stored = await self._found(key, response_id)
        items = stored.input_items[::-1] if descending else stored.input_items
        query = request.query_params
        if query.get("after") is not None:
            items = items[_position(items, query["after"], "after") + 1 :]
        if query.get("before") is not None:
            # The page just before it: the ones nearest it.
            items = items[: _position(items, query["before"], "before")][::-1]
            page = items[:limit][::-1]
        else:
            page = items[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
        )

    async def delete(self, request: Request) -> Response:
        key, response_id = self._named(request)
        async with self.gateway.reading(key, response_id):
            if not await self.store.delete(_scope(key), response_id):
                raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    def _named(self, request: Request) -> tuple[ApiKey | None, str]:
        """The caller's key and the response named in the path (a 404 for a name no response
        has, before any Redis command)."""
        key = self.gateway.auth.api_key(request)
        response_id = request.path_params["response_id"]
        if not is_response_id(response_id):
            raise _not_found(response_id)
        return key, response_id

    async def _found(self, key: ApiKey | None, response_id: str) -> StoredResponse:
        stored = await self._stored(key, response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored

    async def _stored(self, key: ApiKey | None, response_id: str) -> StoredResponse | None:
        return await self.store.load(_scope(key), response_id)


def _scope(key: ApiKey | None) -> str:
    """Whose stored responses a caller sees: its API key's (anonymous without keys)."""
    return key.name if key is not None else ANONYMOUS


def _not_found(response_id: str) -> ApiError:
    # Another key's response reads as one never stored: its existence is not told.
    return ApiError(404, f"Response with id {response_id!r} not found.", code="response_not_found")


def _page(request: Request) -> tuple[int, bool]:
    """``limit`` (1-100, 20) and whether ``order`` is ``desc`` (the default, as OpenAI's)."""
    query = request.query_params
    raw = query.get("limit")
    try:
        limit = int(raw) if raw is not None else DEFAULT_PAGE
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise bad_request(f"limit must be an integer from 1 to {MAX_PAGE}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be asc or desc", param="order")
    return limit, order == "desc"


def _position(items: list[dict[str, Any]], item_id: str, param: str) -> int:
    """Where the item ``after`` or ``before`` names is; a 400 naming the parameter if none."""
    for at, item in enumerate(items):
        if item["id"] == item_id:
            return at
    raise bad_request(f"no input item {item_id[:128]!r} in this response", param=param)
