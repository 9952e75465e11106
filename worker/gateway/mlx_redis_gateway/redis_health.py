"""``/health``'s look at Redis: answered within a second even while every command slot of
the gateway is taken (a flood of reads waits its turn; the health check does not queue
behind it).

The probe reads the catalogue (the models live workers serve) outside the client's command
bound, on the pool's one connection kept beside it (the bound is ``max_in_flight``, the pool
``max_in_flight + 2``: the other is the pub/sub connection). One read at a time: concurrent
health checks share the read under way, so a flood of them holds one connection, not many.
"""

from __future__ import annotations

import asyncio

from mlx_redis_protocol.catalogue import served_models
from mlx_redis_protocol.client import Client
from mlx_redis_protocol.connection import is_unavailable
from mlx_redis_protocol.errors import RedisUnavailable


class HealthProbe:
    def __init__(self, client: Client) -> None:
        self.client = client
        self._reading: asyncio.Future[frozenset[str]] | None = None

    async def served_models(self) -> frozenset[str]:
        """The served models; RedisUnavailable when Redis cannot be reached."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read())
        return await asyncio.shield(self._reading)

    async def _read(self) -> frozenset[str]:
        try:
            redis = await self.client.connect()
            return frozenset(await served_models(redis, self.client.keys))
        except Exception as exc:
            if isinstance(exc, RedisUnavailable):
                raise
            if is_unavailable(exc):
                raise RedisUnavailable(
                    f"the fleet's models could not be read: Redis unreachable "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
            raise
