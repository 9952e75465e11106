"""Process-level entry points: ``mlx-worker run`` (signals, exit codes) and ``health``."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import structlog

from protocol.connection import UnsupportedRedis, connect, redact
from protocol.keys import Keys
from worker.daemon.backoff import REDIS_FAILURES, REDIS_REFUSED, describe
from worker.daemon.eviction import EvictingRedis
from worker.daemon.settings import WorkerSettings
from worker.daemon.worker import Worker

log = structlog.get_logger(__name__)

EXIT_FORCED = 130


def serve(settings: WorkerSettings) -> int:
    """Run the worker until SIGTERM/SIGINT; a second signal exits at once."""

    async def main() -> int:
        worker = Worker(settings)
        loop = asyncio.get_running_loop()
        signals_seen = 0

        def on_signal(signum: int) -> None:
            nonlocal signals_seen
            signals_seen += 1
            if signals_seen > 1:
                log.warning("second_signal_exiting_now", signal=signal.Signals(signum).name)
                os._exit(EXIT_FORCED)
            log.info("signal_received", signal=signal.Signals(signum).name)
            worker.request_stop()

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
        return await worker.run()

    try:
        return asyncio.run(main())
    except REDIS_REFUSED as exc:
        print(
            f"mlx-worker: Redis refused us at {redact(settings.redis_url)}: {exc}", file=sys.stderr
        )
        return 2
    except (EvictingRedis, UnsupportedRedis) as exc:
        print(f"mlx-worker: {exc}", file=sys.stderr)
        return 2


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
