"""Fault scenarios on the network side: a Redis Cluster, a Sentinel failover, a stalled Redis.
Each is a Redis set-up, workers and a fault, run through ``faults_harness.run_stage``."""

from __future__ import annotations

# `mlx_redis_worker` must be imported before anything imports mlx: it loads OpenBLAS first.
import mlx_redis_worker  # noqa: F401  # isort: skip

import asyncio
import contextlib
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

from mlx_redis_protocol.client import Client
from mlx_redis_worker.local_redis import LocalCluster, LocalSentinel, RedisServer
from tests.reliability.faults_checks import JobSpec, invalid_specs, valid_specs
from tests.reliability.faults_harness import (
    Progress,
    Stage,
    longest_pause,
    publisher_total,
    run_stage,
)
from tests.reliability.workers import ONE_BLAS_THREAD, start_workers
from tests.support.drivers import DriverResult, work_directory
from tests.support.processes import WorkerProcess, mlx_worker
from tests.support.prompts import random_prompts
from tests.support.references import tiny_reference


@dataclass
class FaultConfig:
    scenario: str
    jobs: int
    max_tokens: int = 16
    workers: int = 2
    invalid: int = 0
    max_concurrency: int = 8
    lease_seconds: float = 2.0
    max_deliveries: int = 10
    prompts: int = 48  # distinct prompts, reused round-robin (the prefix cache gets hits)
    seed: int = 1
    stalls: int = 3
    stall_seconds: float = 3.0
    replica_lag: float = 0.0  # sentinel: SIGSTOP the replica this long before the kill
    oom_seconds: float = 5.0
    event_timeout: float = 60.0
    directory: Path | None = None

    @property
    def prefix(self) -> str:
        return f"faults-{self.scenario}"

    def workdir(self) -> Path:
        return work_directory(self.directory, self.prefix)


def worker_options(config: FaultConfig, **options: Any) -> dict[str, Any]:
    flags = ("--max-deliveries", str(config.max_deliveries), *options.pop("flags", ()))
    return {
        "max_concurrency": config.max_concurrency,
        "lease_seconds": config.lease_seconds,
        "flags": flags,
        "env": {**ONE_BLAS_THREAD, **options.pop("env", {})},
        **options,
    }


def workers_for(
    config: FaultConfig, url: str, directory: Path, count: int | None = None, **options: Any
) -> list[WorkerProcess]:
    count = config.workers if count is None else count
    return start_workers(count, url, config.prefix, directory, **worker_options(config, **options))


def stage_for(
    config: FaultConfig, url: str, rids: Sequence[str] | None = None, fault: Any = None
) -> Stage:
    """The jobs (valid greedy ones plus ``config.invalid`` invalid entries) and their greedy
    references from an engine run in this process; the workers are added once started (so
    that ``run_stage`` kills them whatever fails)."""
    prompts = random_prompts(config.prompts, seed=config.seed, words=(4, 9))
    rids = list(rids or [f"{config.scenario}-{i:05d}" for i in range(config.jobs)])
    specs: list[JobSpec] = valid_specs(rids, prompts, config.max_tokens)
    for index, bad in enumerate(invalid_specs(config.scenario, config.invalid)):
        # Spread through the queue: a realistic mix, read while the valid jobs run.
        specs.insert((index + 1) * len(specs) // (config.invalid + 1), bad)
    references = tiny_reference().by_prompt(prompts, config.max_tokens)
    return Stage(url, config.prefix, specs, references, [], fault, config.event_timeout)


@contextlib.contextmanager
def started(given: Any, kind: Any, **options: Any) -> Iterator[Any]:
    """The given Redis set-up, or a fresh one of ``kind`` closed afterwards."""
    if given is not None:
        yield given
        return
    with kind(**options) as fresh:
        yield fresh


# -- 1. cluster -----------------------------------------------------------------------------------


def run_cluster(config: FaultConfig, cluster: LocalCluster | None = None) -> DriverResult:
    """Two workers and one Client on a 3-master Cluster (node 0's URL); request ids spread
    over the three nodes; then the CLI for a request whose keys live off node 0."""
    directory = config.workdir()
    with started(cluster, LocalCluster) as cluster:
        owner = cluster.slot_owners()
        ports = [node.port for node in cluster.nodes]
        rids = [f"cluster-{i:05d}" for i in range(config.jobs)]
        per_node = Counter(owner[key_slot(rid.encode())] for rid in rids)
        stage = stage_for(config, cluster.url, rids)
        stage.workers += workers_for(config, cluster.url, directory)
        # After the run, while the workers still serve: the CLI through node 0's URL for a
        # request whose keys live on another node.
        candidates = (f"cluster-cli-{i}" for i in range(1000))
        rid = next(r for r in candidates if owner[key_slot(r.encode())] != ports[0])
        prompt = stage.specs[0].prompt or ""
        stage.after = lambda: {
            "cli": _cli_round(cluster.url, config, rid, prompt, stage.references[prompt])
        }
        outcome = run_stage(stage, "Cluster: 3 masters, one URL (node 0)", directory)
        logs_per_node = [_count_keys(port, f"{config.prefix}:log:*") for port in ports]
    result = outcome.result
    cli = result.values["cli"]
    result.problems += cli.pop("problems")
    if sorted(per_node) != sorted(ports):
        result.problems.append(f"request ids land on {dict(per_node)}, not on all 3 nodes")
    per_node[owner[key_slot(rid.encode())]] += 1  # the CLI's request
    if logs_per_node != [per_node[p] for p in ports]:
        result.problems.append(f"replay logs per node {logs_per_node}, hash slots say {per_node}")
    result.values.update(per_node=[per_node[p] for p in ports], logs_per_node=logs_per_node)
    result.figures += [
        (
            "request ids per node, the CLI's included (node 0 / 1 / 2)",
            " / ".join(str(per_node[p]) for p in ports),
        ),
        ("replay logs found per node at the end", " / ".join(map(str, logs_per_node))),
        (
            f"CLI via node 0 for {rid} (keys on node {ports.index(owner[key_slot(rid.encode())])}):"
            " submit / stream / ctl stats exit",
            f"{cli['submit_rc']} / {cli['stream_rc']} / {cli['stats_rc']}",
        ),
        (
            "publisher round trips per engine step (`mlx-worker ctl stats`)",
            f"{cli['round_trips_per_step']:.2f} ({cli['round_trips']} / {cli['steps']})",
        ),
    ]
    return result


def _count_keys(port: int, pattern: str) -> int:
    client = redis.Redis(port=port, socket_timeout=5)
    try:
        return sum(1 for _ in client.scan_iter(match=pattern, count=1000))
    finally:
        client.close()


def _cli_round(url: str, config: FaultConfig, rid: str, prompt: str, want: str) -> dict[str, Any]:
    """``mlx-worker submit``, ``stream`` and ``ctl stats`` with node 0's URL."""
    base = ["--redis-url", url, "--prefix", config.prefix]
    tokens = str(config.max_tokens)
    submit = mlx_worker(
        "submit",
        prompt,
        "--raw",
        "--request-id",
        rid,
        "--max-tokens",
        tokens,
        "--temperature",
        "0",
        *base,
        "--json",
        "--timeout",
        "60",
    )
    stream = mlx_worker("stream", rid, *base, "--json", "--timeout", "60")
    stats = mlx_worker("ctl", "stats", *base, "--json", "--timeout", "5")
    problems = []
    for name, run in (("submit", submit), ("stream", stream), ("ctl stats", stats)):
        if run.returncode != 0:
            problems.append(f"CLI {name} exited {run.returncode}: {run.stderr.strip()[:300]}")
    texts = [_done_text(run.stdout) for run in (submit, stream)]
    if texts != [want, want]:
        problems.append(f"CLI texts {texts} != greedy {want!r}")
    replies = [json.loads(line) for line in stats.stdout.splitlines() if line.startswith("{")]
    if len(replies) != config.workers:
        problems.append(f"CLI ctl stats: {len(replies)} replies from {config.workers} workers")
    results = [reply.get("result") or {} for reply in replies]
    steps = publisher_total(results, "steps")
    trips = publisher_total(results, "round_trips")
    return {
        "submit_rc": submit.returncode,
        "stream_rc": stream.returncode,
        "stats_rc": stats.returncode,
        "steps": steps,
        "round_trips": trips,
        "round_trips_per_step": trips / steps if steps else float("nan"),
        "problems": problems,
    }


def _done_text(stdout: str) -> str | None:
    for line in stdout.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and event.get("type") == "done":
                return str(event.get("output_text"))
    return None


# -- 2. sentinel ----------------------------------------------------------------------------------


def run_sentinel(config: FaultConfig, sentinel: LocalSentinel | None = None) -> DriverResult:
    """Workers and Client on the redis+sentinel URL; the jobs replicated (WAIT) once queued;
    the master SIGKILLed once a third are done; the workers must follow the new master."""
    directory = config.workdir()
    with started(sentinel, LocalSentinel) as sentinel:

        async def failover(client: Client, progress: Progress) -> dict[str, Any]:
            master = sentinel.master_port()
            acked = await asyncio.to_thread(_wait_replica, master, config.prefix)
            await progress.until_ended(progress.followed // 3)
            done_at_kill = len(progress.ended)
            replica = next(s for s in (sentinel.master, sentinel.replica) if s.port != master)
            if config.replica_lag > 0:  # the replica misses the master's last writes
                os.kill(replica.pid or 0, signal.SIGSTOP)
                await asyncio.to_thread(_drop_replicas, master)
                await asyncio.sleep(config.replica_lag)
            killed_at = time.time()
            old = sentinel.kill_master()
            if config.replica_lag > 0:
                os.kill(replica.pid or 0, signal.SIGCONT)
            new = await asyncio.to_thread(sentinel.wait_failover, old, 60.0)
            return {
                "replicas_acked": acked,
                "done_at_kill": done_at_kill,
                "killed_at": killed_at,
                "failover_seconds": time.time() - killed_at,
                "old_master": old,
                "new_master": new,
            }

        stage = stage_for(config, sentinel.url, fault=failover)
        stage.workers += workers_for(config, sentinel.url, directory)
        outcome = run_stage(stage, "Sentinel: SIGKILL of the master mid-run", directory)
    result, values = outcome.result, outcome.result.values
    if not all(values["same_process_running"]):
        result.problems.append(f"a worker died or restarted: {values['same_process_running']}")
    ends = [f.ended_at for f in outcome.driven.followed.values() if f.ended_at is not None]
    values["pause"] = longest_pause([*ends, values["killed_at"]])
    result.figures += [
        ("replicas holding the queued jobs (WAIT 1 2000)", values["replicas_acked"]),
        ("replica cut off before the SIGKILL (s; its writes lost)", config.replica_lag),
        ("requests done when the master was SIGKILLed", values["done_at_kill"]),
        ("failover seconds (SIGKILL to the replica promoted)", values["failover_seconds"]),
        ("longest pause between two completions (s)", values["pause"]),
        ("jobs that needed a new attempt", outcome.tally.redelivered),
        (
            "workers still the same process, running, before the final stop",
            f"{sum(values['same_process_running'])} / {len(values['same_process_running'])}",
        ),
    ]
    return result


def _drop_replicas(port: int) -> None:
    """Cut the master's link to its (stopped) replica: what the master writes from now on
    reaches no replica, as on a partitioned network."""
    client = redis.Redis(port=port, socket_timeout=5)
    try:
        client.client_kill_filter(_type="replica")
    finally:
        client.close()


def _wait_replica(port: int, prefix: str) -> int:
    """The producer's durability choice: WAIT until a replica holds every write so far (a
    write on the same connection first: WAIT covers that connection's last write, and the
    replication stream is one, so everything before it too)."""
    client = redis.Redis(port=port, socket_timeout=5)
    try:
        pipe = client.pipeline(transaction=False)
        pipe.set(f"{prefix}:durable", b"1")
        pipe.execute_command("WAIT", 1, 2000)
        return int(pipe.execute()[1])
    finally:
        client.close()


# -- 3. stall -------------------------------------------------------------------------------------

STALL_ENV = {"MLXW_SOCKET_TIMEOUT": "2", "MLXW_READ_BLOCK_MS": "200"}


def run_stall(config: FaultConfig) -> DriverResult:
    """``DEBUG SLEEP`` longer than the workers' socket timeout, a few times while jobs run:
    every publish in flight times out and is sent again; the script must write nothing twice."""
    directory = config.workdir()
    server = RedisServer(
        extra_args=["--enable-debug-command", "local"], directory=directory / "redis"
    )
    with server:

        async def stalls(client: Client, progress: Progress) -> dict[str, Any]:
            seconds = 0.0
            for index in range(config.stalls):
                await progress.until_ended(progress.followed * (index + 1) // (config.stalls + 1))
                began = time.monotonic()
                await asyncio.to_thread(_debug_sleep, server.port, config.stall_seconds)
                seconds += time.monotonic() - began
            return {"stalls": config.stalls, "stall_seconds": seconds}

        stage = stage_for(config, server.url, fault=stalls)
        stage.workers += workers_for(config, server.url, directory, env=STALL_ENV)
        outcome = run_stage(stage, "Stall: DEBUG SLEEP past the socket timeout", directory)
    result, values = outcome.result, outcome.result.values
    raised = values["stream_exceptions_caught"] + values["stream_exceptions_escaped"]
    if raised:
        result.problems.append(f"subscriber streams raised {raised} times during the stalls")
    if not values["publisher_redis_failures"]:
        result.problems.append("no publisher timeout: the stalls did not hit a publish")
    result.figures += [
        ("stalls (DEBUG SLEEP, socket timeout 2 s)", values["stalls"]),
        ("stall seconds", values["stall_seconds"]),
        ("publisher redis_failures (ctl stats)", values["publisher_redis_failures"]),
    ]
    return result


def _debug_sleep(port: int, seconds: float) -> None:
    client = redis.Redis(port=port, socket_timeout=seconds + 10)
    try:
        client.execute_command("DEBUG", "SLEEP", seconds)
    finally:
        client.close()
