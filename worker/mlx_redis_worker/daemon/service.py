"""Process-level entry point of ``mlx-worker run`` (signals, exit codes); ``health`` is in
``daemon.health``, which imports no MLX."""

from __future__ import annotations

import asyncio
import os
import signal

import structlog

from mlx_redis_protocol.connection import UnsupportedRedis, redact
from mlx_redis_protocol.logs import one_line, tell_operator
from mlx_redis_protocol.permissions import MissingPermission
from mlx_redis_protocol.redis_retry import REDIS_REFUSED
from mlx_redis_worker.daemon.claim import EXIT_ID_HELD, WorkerIdHeld
from mlx_redis_worker.daemon.eviction import EvictingRedis
from mlx_redis_worker.daemon.settings import WorkerSettings
from mlx_redis_worker.daemon.worker import RedisNeverAnswered, Worker
from mlx_redis_worker.models.loading import ModelUnavailable

log = structlog.get_logger(__name__)

# `mlx-worker run`'s exit statuses besides 0 and 1 (the table: README.md, "Operating the
# worker").
EXIT_USAGE = 2  # settings, model, or a Redis that refuses us or would evict our keys
EXIT_FORCED = 130  # a second SIGTERM/SIGINT while stopping
# Redis never answered at start (redis_start_timeout): sysexits' EX_TEMPFAIL, "try again later",
# which service managers restart as any failure.
EXIT_REDIS_NEVER_ANSWERED = 75


def serve(settings: WorkerSettings, *, debug: bool = False) -> int:
    """Run the worker until SIGTERM/SIGINT; a second signal exits at once. Exit statuses:
    0 a clean stop (also one requested before serving), 2 a configuration the worker cannot
    serve with (one line on stderr; the traceback too with ``debug``), 3 its worker id held
    by a live worker (one line naming it), 75 a Redis that did not answer within
    ``redis_start_timeout`` of the start (one line too), 130 a second signal.
    Anything unexpected propagates: ``mlx-worker`` turns it into one line and status 1."""

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
        return _refused(
            f"Redis refused us at {redact(settings.redis_url)}: {one_line(exc)}", exc, debug
        )
    except (EvictingRedis, UnsupportedRedis, MissingPermission, ModelUnavailable) as exc:
        return _refused(one_line(exc), exc, debug)
    except WorkerIdHeld as exc:
        tell_operator(f"mlx-worker: {one_line(exc)}", exc, debug=debug)
        return EXIT_ID_HELD
    except RedisNeverAnswered as exc:
        tell_operator(f"mlx-worker: {one_line(exc)}", exc, debug=debug)
        return EXIT_REDIS_NEVER_ANSWERED


def _refused(line: str, exc: BaseException, debug: bool) -> int:
    """One line for the operator (after the traceback with ``debug``); the usage status."""
    tell_operator(f"mlx-worker: {line}", exc, debug=debug)
    return EXIT_USAGE
