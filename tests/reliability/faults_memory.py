"""Fault scenarios on the memory side: a Redis out of memory under ``noeviction``, and the
worker refusing a Redis that may evict its keys."""

from __future__ import annotations

# `mlx_redis_worker` must be imported before anything imports mlx: it loads OpenBLAS first.
import mlx_redis_worker  # noqa: F401  # isort: skip

import asyncio
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.exceptions import OutOfMemoryError

from mlx_redis_protocol.client import Client
from mlx_redis_worker.local_redis import RedisServer
from tests.reliability.faults_harness import Progress, run_stage
from tests.reliability.faults_scenarios import (
    FaultConfig,
    stage_for,
    worker_options,
    workers_for,
)
from tests.reliability.workers import worker_process
from tests.support.drivers import DriverResult
from tests.support.processes import mlx_worker

MIB = 1024 * 1024
FILLER_BYTES = 64 * 1024
HEADROOM = 2 * MIB

# -- 4. oom ---------------------------------------------------------------------------------------


def run_oom(config: FaultConfig) -> DriverResult:
    """Valid and invalid entries queued, then Redis pushed out of memory (``maxmemory`` just
    above what it holds, filler keys until it refuses) and held there while the workers work;
    then the filler goes. Nothing may be lost, the logs must show bursts, not every retry."""
    directory = config.workdir()
    server = RedisServer(
        extra_args=["--maxmemory-policy", "noeviction"], directory=directory / "redis"
    )
    with server:
        # Started while Redis is full: it must wait (one burst) and serve once it is freed.
        late = worker_process(
            "late", server.url, config.prefix, directory, **worker_options(config)
        )

        def start_late() -> None:
            stage.workers.append(late)  # stopped (or killed) with the others
            late.start()

        async def out_of_memory(client: Client, progress: Progress) -> dict[str, Any]:
            found = await asyncio.to_thread(
                _hold_oom, server.port, config.prefix, config.oom_seconds, progress, start_late
            )
            freed = time.monotonic()
            await asyncio.to_thread(late.wait_ready)
            ready_after = time.monotonic() - freed
            # "Ready" means reachable: a broadcast sent at once counts and reaches it.
            pinged = {reply.worker_id for reply in await client.ping(timeout=10)}
            return {
                **found,
                "late_ready_after_free": ready_after,
                "late_answered_ping_at_ready": late.worker_id in pinged,
            }

        stage = stage_for(config, server.url, fault=out_of_memory)
        stage.workers += workers_for(config, server.url, directory)
        outcome = run_stage(stage, "OOM: Redis full under noeviction", directory)
    result, values = outcome.result, outcome.result.values
    refusals, failing = values["oom_refusals"], outcome.tally.redis_failing
    if not values["filled"] or values["probe_writes_accepted"]:
        result.problems.append(
            f"Redis was not held full: filled {values['filled']}, "
            f"{values['probe_writes_accepted']} probe writes accepted while held"
        )
    if not values["late_answered_ping_at_ready"]:
        result.problems.append("the worker started while full missed a ping sent at its ready")
    if refusals < 2 * max(failing, 1):
        result.problems.append(
            f"{failing} redis_failing lines for {refusals} OOM refusals: not logged per burst"
        )
    result.figures += [
        (
            "OOM seconds (filled until refused, then held 2 MiB over maxmemory)",
            values["oom_seconds"],
        ),
        ("OOM refusals the workers got (errorstat_OOM, the filler's own excluded)", refusals),
        ("publisher redis_failures (ctl stats)", values["publisher_redis_failures"]),
        ("redis_failing log lines (one per burst)", failing),
        ("requests that ended while Redis was full", values["ended_during_oom"]),
        ("worker heartbeat keys alive at the end of the OOM", values["heartbeats_at_end_of_oom"]),
        (
            "worker started while Redis was full: seconds to worker_ready after the free",
            values["late_ready_after_free"],
        ),
        ("it answered a ping sent at its ready", values["late_answered_ping_at_ready"]),
    ]
    return result


def _hold_oom(
    port: int, prefix: str, seconds: float, progress: Progress, while_full: Callable[[], object]
) -> dict[str, Any]:
    """``maxmemory`` just above ``used_memory``, filler keys until Redis answers OOM; then
    ``maxmemory`` a little under what it holds (HEADROOM), again before every probe write,
    so that what Redis frees meanwhile cannot let writes slip through; ``seconds`` later, all
    freed."""
    client = redis.Redis(port=port, socket_timeout=10)
    try:
        before = _oom_errors(client)
        client.config_set("maxmemory", _used(client) + 2 * MIB)
        keys: list[str] = []
        own = 0
        while len(keys) < 10_000:
            try:
                client.set(f"{prefix}:filler:{len(keys)}", b"x" * FILLER_BYTES)
            except OutOfMemoryError:
                own += 1
                break
            keys.append(f"{prefix}:filler:{len(keys)}")
        filled = own > 0
        client.config_set("maxmemory", _used(client) - HEADROOM)
        began = time.monotonic()
        ended_before = len(progress.ended)
        while_full()
        slipped = 0
        while time.monotonic() - began < seconds:
            # The workers free memory as they go (acked entries are deleted): tighten again,
            # then check with a probe write that Redis still refuses.
            client.config_set("maxmemory", max(_used(client) - HEADROOM, 1))
            time.sleep(0.1)
            try:
                client.set(f"{prefix}:filler:probe", b"x")
                slipped += 1
            except OutOfMemoryError:
                own += 1
        ended_during = len(progress.ended) - ended_before
        heartbeats = sum(1 for _ in client.scan_iter(match=f"{prefix}:worker:*"))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])
        client.config_set("maxmemory", 0)
        return {
            "filled": filled,
            "filler_keys": len(keys),
            "oom_seconds": time.monotonic() - began,
            "oom_refusals": _oom_errors(client) - before - own,
            "probe_writes_accepted": slipped,
            "ended_during_oom": ended_during,
            "heartbeats_at_end_of_oom": heartbeats,
        }
    finally:
        client.close()


def _used(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def _oom_errors(client: redis.Redis) -> int:
    stats = client.info("errorstats").get("errorstat_OOM", {})
    return int(stats.get("count", 0)) if isinstance(stats, dict) else 0


# -- 5. eviction ----------------------------------------------------------------------------------

REFUSED_POLICIES = ("allkeys-lru", "volatile-lru")
# How long a refused start may take: an interpreter's start and Redis' answer, generous for a
# loaded machine, far below what loading a model and serving would take.
REFUSED_WITHIN_SECONDS = 60.0
# How long a worker that serves nothing gets to stop on SIGTERM before it counts as hung.
STOP_TIMEOUT = 120.0


def run_eviction(config: FaultConfig) -> DriverResult:
    """``mlx-worker run`` against an evicting Redis exits 2 with one line, before loading
    the model; ``--allow-eviction`` runs and serves; ``noeviction`` starts."""
    directory = config.workdir()
    server = RedisServer(
        extra_args=["--maxmemory", "64mb", "--maxmemory-policy", REFUSED_POLICIES[0]],
        directory=directory / "redis",
    )
    problems: list[str] = []
    refusals: dict[str, dict[str, Any]] = {}
    with server:
        admin = redis.Redis(port=server.port, socket_timeout=5)
        for policy in REFUSED_POLICIES:
            admin.config_set("maxmemory-policy", policy)
            refusals[policy] = found = _refused_start(server.url, config.prefix, policy)
            problems += [f"{policy}: {problem}" for problem in found.pop("problems")]
        admin.config_set("maxmemory-policy", REFUSED_POLICIES[0])
        stage = stage_for(config, server.url)
        stage.workers += workers_for(config, server.url, directory, flags=("--allow-eviction",))
        workers = list(stage.workers)
        outcome = run_stage(stage, "Eviction: maxmemory-policy check at start", directory)
        warned = sum(
            event.get("event") == "redis_may_evict_allowed"
            for w in workers
            for event in w.log_events()
        )
        admin.config_set("maxmemory-policy", "noeviction")
        began = time.monotonic()
        plain = worker_process("plain", server.url, config.prefix, directory).start()
        try:
            plain.wait_ready()
            ready_seconds = time.monotonic() - began
        finally:
            # The step checked is SIGTERM -> exit 0; the wait only guards against a hang. Its
            # 30 s default was run out under a loaded machine (2 cores, 4 test processes):
            # the worker was killed, reported as a stop with None.
            plain_rc = plain.stop(timeout=STOP_TIMEOUT)
            plain_log = plain.log_tail()
        admin.close()
    result = outcome.result
    result.problems += problems
    if warned != len(workers):
        result.problems.append(f"{warned} redis_may_evict_allowed warnings from {len(workers)}")
    if plain_rc != 0:
        result.problems.append(
            f"the worker on a noeviction Redis stopped with {plain_rc}; its log:\n{plain_log}"
        )
    result.values.update(refusals=refusals, allowed_warnings=warned, noeviction_rc=plain_rc)
    for policy, found in refusals.items():
        result.figures.append(
            (
                f"`mlx-worker run` on {policy}: exit code, seconds, stderr lines",
                f"{found['rc']}, {found['seconds']:.1f} s, {found['stderr_lines']}",
            )
        )
    result.figures += [
        (
            "with --allow-eviction: served (done / jobs), warnings logged",
            f"{outcome.tally.done} / {outcome.tally.jobs}, {warned}",
        ),
        (
            "on noeviction: seconds to worker_ready, exit code after SIGTERM",
            f"{ready_seconds:.1f} s, {plain_rc}",
        ),
    ]
    return result


def _refused_start(url: str, prefix: str, policy: str) -> dict[str, Any]:
    began = time.monotonic()
    run = mlx_worker(
        "run",
        "--model",
        "tiny",
        "--redis-url",
        url,
        "--prefix",
        prefix,
        "--worker-id",
        f"refused-{policy}",
    )
    seconds = time.monotonic() - began
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    problems = []
    if run.returncode != 2:
        problems.append(f"exit {run.returncode}, want 2; stderr: {run.stderr[-500:]}")
    if len(lines) != 1 or policy not in lines[0] or "--allow-eviction" not in lines[0]:
        problems.append(f"stderr is not one line naming {policy} and --allow-eviction: {lines}")
    if run.stdout.strip():
        problems.append(f"stdout not empty: {run.stdout[:300]}")
    if seconds > REFUSED_WITHIN_SECONDS:
        problems.append(f"took {seconds:.1f} s to exit")
    return {
        "rc": run.returncode,
        "seconds": seconds,
        "stderr_lines": len(lines),
        "stderr": lines,
        "problems": problems,
    }
