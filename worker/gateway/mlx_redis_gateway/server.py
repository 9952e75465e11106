"""The gateway's HTTP server: uvicorn, with httptools under the HTTP limits' guard, telling
systemd (``Type=notify``) when it serves.

READY is sent once the socket listens (uvicorn starts the app's lifespan, which connects to
Redis, before it binds: a READY from the lifespan would come before any request could be
answered); the watchdog is pinged from the event loop, so a loop that blocks stops the pings
and systemd restarts the gateway after ``WatchdogSec``; STOPPING is sent when shutdown begins.
Outside systemd the notifier does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import structlog
import uvicorn
from starlette.applications import Starlette

from mlx_redis_gateway.http_limits import HttpLimits, guarded_protocol
from mlx_redis_protocol.heap import freeze_start_up_heap
from mlx_redis_protocol.sd_notify import Notifier

log = structlog.get_logger(__name__)


class NotifyingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, notifier: Notifier) -> None:
        super().__init__(config)
        self.notifier = notifier
        self._watchdog: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.should_exit:  # the lifespan or the bind failed: never ready
            return
        log.info("gateway_listening", frozen_objects=freeze_start_up_heap())
        self.notifier.ready(status=f"serving on {self.config.host}:{self.config.port}")
        # Healthy while the loop runs: a gateway that cannot reach Redis answers 503s and
        # recovers on its own; a restart would not help it.
        self._watchdog = asyncio.create_task(self.notifier.keep_alive(lambda: True))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.notifier.stopping(status="draining open streams")
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        await super().shutdown(sockets)


def serve(app: Starlette, host: str, port: int, limits: HttpLimits) -> None:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,  # structlog already owns the output
        access_log=False,
        http=guarded_protocol(limits),
        server_header=False,  # no banner naming the server and its version
        lifespan="on",
        timeout_graceful_shutdown=30,
        # Longer than a load balancer's idle timeout (60 s is common), so the balancer, not
        # the gateway, closes an idle connection: no request races a closing socket.
        timeout_keep_alive=75,
    )
    NotifyingServer(config, Notifier()).run()
