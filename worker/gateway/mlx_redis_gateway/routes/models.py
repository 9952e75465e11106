"""``GET /v1/models``, ``GET /v1/models/{id}`` and ``GET /health``: what the fleet serves."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_redis_gateway.gateway import Gateway
from mlx_redis_protocol.errors import RedisUnavailable


class ModelRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def models(self, request: Request) -> Response:
        self.gateway.auth.api_key(request)
        client = self.gateway.client
        served = await client.served_models()
        data = [_model_object(name, await client.media_of(name)) for name in sorted(served)]
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        """One served model (``client.models.retrieve``); 404 ``model_not_found`` otherwise."""
        self.gateway.auth.api_key(request)
        name = request.path_params["model"]
        await self.gateway.check_served(name)
        return JSONResponse(_model_object(name, await self.gateway.client.media_of(name)))

    async def health(self, request: Request) -> Response:
        """200 while Redis answers, 503 only when it cannot be reached; how busy the
        gateway's Redis commands are is told beside (``redis.saturated``), not as a failure."""
        load = self.gateway.client.command_load()
        try:
            served = await self.gateway.health.served_models()
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


def _model_object(name: str, media: frozenset[str]) -> dict[str, Any]:
    """OpenAI's model object, and what it takes (``input_modalities``: ``text``, and
    ``image``/``video`` for a vision-language model)."""
    modalities = ["text", *(kind for kind in ("image", "video") if kind in media)]
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "mlx-redis-worker",
        "input_modalities": modalities,
    }
