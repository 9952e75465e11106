"""One process of a simulated fleet: many workers, each the real daemon over a stand-in engine.

``python -m mlx_redis_worker.bench.fleet_host SPEC_JSON`` runs ``count`` workers (ids
``{id_prefix}{first..first+count-1}``) on one event loop, each a ``Worker`` with its own Redis
connections, consumer, reclaimer, heartbeat, registry entry, publisher and control listener,
over a ``SimulatedEngine``. It prints ``ready N`` once all serve (``failed ...`` if one stops
before), and stops them all on SIGTERM, each as a worker stops (drain, leave, release its id).
Lanes, not processes, because a process per worker costs a Python interpreter each (about
100 MB and a second of CPU to start): a thousand would not fit a small machine, while the
daemon's work per worker is Redis I/O that one event loop interleaves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import resource
import signal
import sys

from mlx_redis_protocol.limits import DEFAULT_LIMITS
from mlx_redis_protocol.logs import configure_logging
from mlx_redis_worker.bench.fleet_engine import SimulatedEngine
from mlx_redis_worker.bench.fleet_spec import HostSpec
from mlx_redis_worker.daemon.settings import WorkerSettings
from mlx_redis_worker.daemon.worker import Worker, scheduler_config

START_WAVE = 50


def worker_settings(spec: HostSpec, index: int) -> WorkerSettings:
    settings = WorkerSettings(
        model=spec.model,
        redis_url=spec.redis_url,
        redis_topology=spec.topology,
        prefix=spec.prefix,
        worker_id=f"{spec.id_prefix}{index:05d}",
        max_concurrency=spec.max_concurrency,
        heartbeat_interval=spec.heartbeat_interval,
        heartbeat_ttl=3 * spec.heartbeat_interval,
        activity_interval=spec.activity_interval,
        reclaim_interval=spec.reclaim_interval,
        lease_seconds=spec.lease_seconds,
        drain_timeout=5.0,
        # A thousand workers starting on a loaded small machine wait their turn longer than
        # a service's 60 s; the bench bounds the whole start instead.
        redis_start_timeout=600.0,
        log_format="json",
        log_level="WARNING",
    )
    if spec.read_block_ms > 0:
        settings = dataclasses.replace(settings, read_block_ms=spec.read_block_ms)
    return settings


def simulated_worker(spec: HostSpec, index: int) -> Worker:
    settings = worker_settings(spec, index)
    engine = SimulatedEngine(
        step_seconds=spec.step_seconds,
        scheduler_config=scheduler_config(
            max_concurrency=spec.max_concurrency, limits=DEFAULT_LIMITS
        ),
        epoch=spec.epoch,
        model_name=spec.model,
    )
    return Worker(settings, engines={settings.default_model_name: engine})


async def run_host(spec: HostSpec) -> int:
    workers = [simulated_worker(spec, spec.first + i) for i in range(spec.count)]
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    runs: list[asyncio.Task[int]] = []
    # In waves, as a fleet comes up: a thousand workers checking their permissions at once
    # (each some 70 commands) would time each other out on a small machine.
    for first in range(0, len(workers), START_WAVE):
        wave = workers[first : first + START_WAVE]
        runs += [asyncio.create_task(worker.run()) for worker in wave]
        failure = await _first_failure(wave, runs)
        if failure is not None:
            print(f"failed {failure}", flush=True)
            stop.set()
            break
    else:
        print(f"ready {len(workers)}", flush=True)
    await stop.wait()
    for worker in workers:
        worker.request_stop()
    results = await asyncio.gather(*runs, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException) or r != 0]
    print(f"stopped {len(results) - len(failed)} failed {len(failed)}", flush=True)
    return 0 if not failed else 1


async def _first_failure(wave: list[Worker], runs: list[asyncio.Task[int]]) -> str | None:
    """None once every worker of the wave serves; else why one of the runs ended."""
    ready = asyncio.gather(*(worker.ready.wait() for worker in wave))
    ended = asyncio.ensure_future(asyncio.wait(runs, return_when=asyncio.FIRST_COMPLETED))
    await asyncio.wait((ready, ended), return_when=asyncio.FIRST_COMPLETED)
    ready.cancel()
    ended.cancel()
    if all(worker.ready.is_set() for worker in wave):
        return None
    run = next(task for task in runs if task.done())
    failure = run.exception() if not run.cancelled() else None
    return f"{type(failure).__name__}: {failure}" if failure else f"a worker stopped ({run})"


def main() -> int:
    spec = HostSpec(**json.loads(sys.argv[1]))
    # Each worker holds some 7 connections; mlx-lm's import left the soft limit at 2048.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    configure_logging("json", "WARNING")
    return asyncio.run(run_host(spec))


if __name__ == "__main__":
    sys.exit(main())
