"""``POST /v1/embeddings``: one embedding job per request (``embeddings_api``), its vectors
gathered from its events. Not streamed and not resumable: the answer is one body."""

from __future__ import annotations

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_redis_gateway.embeddings_api import (
    EmbeddingRequest,
    embeddings_body,
    parse_embedding_request,
)
from mlx_redis_gateway.errors import ApiError, from_error_event
from mlx_redis_gateway.gateway import Gateway, client_left, unavailable
from mlx_redis_gateway.token_meter import prompt_token_bound
from mlx_redis_protocol.connection import is_unavailable
from mlx_redis_protocol.embeddings import EmbeddingCollector, EmbeddingFailed, Embeddings
from mlx_redis_protocol.errors import RedisUnavailable

log = structlog.get_logger(__name__)


class EmbeddingRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def create(self, request: Request) -> Response:
        gateway = self.gateway
        key = gateway.auth.api_key(request)
        async with gateway.screening(key):
            accepted = parse_embedding_request(
                await gateway.json_body(request),
                limits=gateway.settings.limits,
                user_key=key.name if key is not None else None,
            )
            await gateway.check_served(accepted.model)
        request_id = accepted.job.request_id
        if key is not None:
            tokens = prompt_token_bound(accepted.job)
            await gateway.quotas.admit_or_refuse(key, request_id, tokens=tokens)
        try:
            await gateway.client.submit_job(accepted.job)
        except BaseException as exc:
            await gateway.quotas.withdraw(request_id)
            if isinstance(exc, RedisUnavailable) or is_unavailable(exc):
                raise unavailable(exc) from exc
            raise
        structlog.contextvars.bind_contextvars(request_id=request_id)
        log.info("gateway_request", kind="embeddings", model=accepted.model, inputs=accepted.inputs)
        result = await gateway.until_disconnected(
            request, self._follow(accepted), on_left=gateway.left(request_id, False)
        )
        if result is None:
            return client_left()
        body = embeddings_body(accepted.model, result, accepted.encoding_format)
        return JSONResponse(body, headers={"x-request-id": request_id})

    async def _follow(self, accepted: EmbeddingRequest) -> Embeddings:
        """The job's vectors once it has ended (followed again from the start if Redis
        rewrote its history); its quota lease is given back then."""
        request_id = accepted.job.request_id
        try:
            while True:
                collector = EmbeddingCollector(request_id)
                try:
                    async for event in self.gateway.events(request_id):
                        collector.feed(event)
                        if collector.finished:
                            break
                except ApiError as error:
                    if error.code == "stream_rewritten":
                        continue
                    raise
                try:
                    return collector.result(accepted.inputs)
                except EmbeddingFailed as failed:
                    raise from_error_event(failed.code, failed.message) from failed
        finally:
            await self.gateway.quotas.release(request_id)
