"""``GET /v1/requests/{id}`` (the finished answer) and ``GET /v1/requests/{id}/stream`` (its
stream again, on any gateway, after the event the client names): reads of a request its
caller's key made, each counted against the key's quota like a completion."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from mlx_redis_gateway.api_keys import ApiKey
from mlx_redis_gateway.errors import ApiError
from mlx_redis_gateway.gateway import Gateway, answer, client_left
from mlx_redis_gateway.openai_api import check_request_id
from mlx_redis_gateway.shaping import ResponseShape


class RequestRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def resume(self, request: Request) -> Response:
        """The request's stream again, after the event the client names (``Last-Event-ID``
        header or ``last_event_id`` query parameter); from the start without one."""
        key = self.gateway.auth.api_key(request)
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
        return self.gateway.stream_response(
            request_id, shape, after=after, abort_when_left=False, lease=lease
        )

    async def result(self, request: Request) -> Response:
        """The finished answer of a request (waits for its end), as a completion object."""
        key = self.gateway.auth.api_key(request)
        lease = await self._admit_read(request, key)
        try:
            request_id, shape = await self._owned(request, key)
            # Another route may be streaming this request: its lease is not this route's.
            following = self.gateway.follow(request_id, shape, holds_lease=False)
            shaper = await self.gateway.until_disconnected(request, following)
        finally:
            await self._release(lease)
        return client_left() if shaper is None else answer(shaper)

    async def _owned(self, request: Request, key: ApiKey | None) -> tuple[str, ResponseShape]:
        """The request named in the path and its shape, if the caller's key made it."""
        client = self.gateway.client
        request_id = check_request_id(request.path_params["request_id"])
        async with client.command_slot() as redis:
            raw = await redis.get(client.keys.gateway_request(request_id))
        shape = ResponseShape.decode(raw) if raw is not None else None
        # Someone else's request reads as missing: its existence is not told.
        if shape is None or (key is not None and shape.owner != key.name):
            raise ApiError(
                404, f"no request {request_id!r} (unknown, or expired)", code="request_not_found"
            )
        return request_id, shape

    async def _admit_read(self, request: Request, key: ApiKey | None) -> str | None:
        """A quota lease for reading the request named in the path (None without keys)."""
        request_id = check_request_id(request.path_params["request_id"])
        return await self.gateway.admit_read(key, request_id)

    async def _release(self, lease: str | None) -> None:
        await self.gateway.release_read(lease)
