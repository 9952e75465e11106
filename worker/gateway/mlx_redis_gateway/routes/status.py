"""The status page (``/``, its self-refreshing ``/status/fragment``) and ``/status.json``,
for operator keys: the fleet as Redis tells it, one read a second however many ask."""

from __future__ import annotations

import asyncio
import time
from typing import Final

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from mlx_redis_gateway.fleet_status import FleetStatus, read_fleet_status
from mlx_redis_gateway.gateway import Gateway
from mlx_redis_gateway.status_page import STATUS_PAGE_CSP, render_fragment, render_page

# How long one read of the fleet's status serves the status page's requests.
STATUS_CACHE_SECONDS: Final = 1.0
_PAGE_HEADERS: Final = {"content-security-policy": STATUS_PAGE_CSP}


class StatusRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self._status: tuple[float, FleetStatus] | None = None
        self._status_lock = asyncio.Lock()

    async def page(self, request: Request) -> Response:
        self.gateway.auth.operator(request)
        return HTMLResponse(render_page(await self._fleet_status()), headers=_PAGE_HEADERS)

    async def fragment(self, request: Request) -> Response:
        self.gateway.auth.operator(request)
        return HTMLResponse(render_fragment(await self._fleet_status()), headers=_PAGE_HEADERS)

    async def json(self, request: Request) -> Response:
        self.gateway.auth.operator(request)
        return JSONResponse((await self._fleet_status()).as_dict())

    async def _fleet_status(self) -> FleetStatus:
        async with self._status_lock:
            now = time.monotonic()
            if self._status is None or now - self._status[0] > STATUS_CACHE_SECONDS:
                client = self.gateway.client
                async with client.command_slot() as redis:
                    self._status = (now, await read_fleet_status(redis, client.keys))
            return self._status[1]
