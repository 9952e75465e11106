"""The OpenAI-compatible gateway: HTTP requests in, jobs on the queue, answers from the log.

A gateway holds no state but Redis (``gateway``), so any number of them can stand behind a
load balancer, and a client that lost its stream resumes it on any of them with
``GET /v1/requests/{id}/stream`` and ``Last-Event-ID``.

This module puts the app together: the routes (``routes/``: ``POST /v1/chat/completions``,
``POST /v1/completions``, ``POST /v1/responses`` (and its stored responses: ``GET`` and
``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``),
``POST /v1/embeddings``, Anthropic's
``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /v1/requests/{id}``, ``GET /v1/requests/{id}/stream``,
``GET /health``, and the status
page's ``/``, ``/status.json`` and ``/status/fragment``), the HTTP limits and browser guard in
front of them, and the error handlers: any other path or method is a 404 or 405 in the error
shape of the API its path belongs to (``errors``: Anthropic's under ``/v1/messages``, OpenAI's
elsewhere), as every other refusal is.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlx_redis_gateway.browser_guard import BrowserGuard
from mlx_redis_gateway.errors import ApiError
from mlx_redis_gateway.gateway import Gateway, unavailable
from mlx_redis_gateway.http_limits import RequestLimits, note_refusal
from mlx_redis_gateway.routes.completions import CompletionRoutes
from mlx_redis_gateway.routes.embeddings import EmbeddingRoutes
from mlx_redis_gateway.routes.messages import MessageRoutes
from mlx_redis_gateway.routes.models import ModelRoutes
from mlx_redis_gateway.routes.requests import RequestRoutes
from mlx_redis_gateway.routes.responses import ResponseRoutes
from mlx_redis_gateway.routes.status import StatusRoutes
from mlx_redis_gateway.settings import GatewaySettings
from mlx_redis_protocol.connection import is_unavailable
from mlx_redis_protocol.errors import RedisUnavailable
from mlx_redis_protocol.redis_retry import describe

__all__ = ["Gateway", "GatewaySettings", "build_app"]

log = structlog.get_logger(__name__)


def build_app(settings: GatewaySettings) -> Starlette:
    gateway = Gateway(settings)
    completions = CompletionRoutes(gateway)
    models = ModelRoutes(gateway)
    requests = RequestRoutes(gateway)
    messages = MessageRoutes(gateway)
    responses = ResponseRoutes(gateway)
    routes = [
        Route("/v1/chat/completions", completions.chat, methods=["POST"]),
        Route("/v1/completions", completions.text, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", responses.input_items, methods=["GET"]),
        Route("/v1/messages", messages.create, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
        Route("/v1/embeddings", EmbeddingRoutes(gateway).create, methods=["POST"]),
        Route("/v1/models", models.models, methods=["GET"]),
        Route("/v1/models/{model:path}", models.model, methods=["GET"]),
        Route("/v1/requests/{request_id}", requests.result, methods=["GET"]),
        Route("/v1/requests/{request_id}/stream", requests.resume, methods=["GET"]),
        Route("/health", models.health, methods=["GET"]),
    ]
    if settings.status_page:
        status = StatusRoutes(gateway)
        routes += [
            Route("/", status.page, methods=["GET"]),
            Route("/status.json", status.json, methods=["GET"]),
            Route("/status/fragment", status.fragment, methods=["GET"]),
        ]
    handlers: Mapping[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        ApiError: _api_error,
        HTTPException: _http_error,
        RedisUnavailable: _unavailable,
        RedisError: _redis_error,
        ClientDisconnect: _client_left,
    }
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(
                RequestLimits, limits=settings.http, on_body_refused=gateway.charge_refused_body
            ),
            Middleware(BrowserGuard, allowed_hosts=settings.checked_hosts()),
        ],
        exception_handlers=handlers,
        lifespan=gateway.lifespan,
    )
    app.state.gateway = gateway
    return app


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, a method the route does not take) in the
    error shape of the path's API, so a client's error handling sees one format for every
    answer."""
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
    return _answer(request, error, exc.headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _answer(request, exc)


def _answer(
    request: Request, error: ApiError, headers: Mapping[str, str] | None = None
) -> Response:
    """The error in the shape (and with the status) of the API the request's path speaks."""
    path = request.url.path
    return JSONResponse(
        error.body_for(path),
        status_code=error.status_for(path),
        headers={**(headers or {}), **error.headers()},
    )


async def _client_left(request: Request, exc: Exception) -> Response:
    """A client that closed its connection before its body arrived whole: counted in the
    refusals' log (one line a second at most, with a count), not a traceback each; the answer
    goes nowhere."""
    note_refusal("client_left_mid_upload")
    return Response(status_code=400)


async def _unavailable(request: Request, exc: Exception) -> Response:
    return await _api_error(request, unavailable(exc))


async def _redis_error(request: Request, exc: Exception) -> Response:
    """Redis said no to a command (an ACL changed under a running gateway, a full Redis): the
    client gets a typed 503, the operator the server's words in the log."""
    if is_unavailable(exc):
        return await _unavailable(request, exc)
    log.error("redis_refused", path=request.url.path, error=describe(exc))
    message = "the queue refused a command the gateway needs; its log says which"
    return await _api_error(request, ApiError(503, message, "server_error", code="redis_refused"))
