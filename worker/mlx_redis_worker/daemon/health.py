"""``mlx-worker health``: whether a worker's heartbeat is alive. A module of its own, without
the daemon's imports (MLX, the engine): a health check answers in a fraction of a second."""

from __future__ import annotations

import asyncio
import sys

from mlx_redis_protocol.connection import UnsupportedRedis, connect
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.redis_retry import REDIS_FAILURES, describe
from mlx_redis_worker.daemon.settings import WorkerSettings


def check_health(settings: WorkerSettings) -> int:
    """0 when the worker's heartbeat key is alive in Redis, 1 otherwise."""

    async def main() -> int:
        try:
            redis = await connect(
                settings.redis_url,
                topology=settings.redis_topology,
                socket_timeout=5,
                socket_connect_timeout=5,
            )
        except (*REDIS_FAILURES, UnsupportedRedis) as exc:
            print(f"mlx-worker health: cannot reach Redis: {describe(exc)}", file=sys.stderr)
            return 1
        try:
            alive = await redis.exists(Keys(settings.prefix).worker(settings.worker_id))
        except REDIS_FAILURES as exc:
            print(f"mlx-worker health: cannot reach Redis: {describe(exc)}", file=sys.stderr)
            return 1
        finally:
            await redis.aclose()
        print(f"{settings.worker_id}: {'alive' if alive else 'no heartbeat'}")
        return 0 if alive else 1

    return asyncio.run(main())
