"""A Cluster failover under clients: 3 masters + 3 replicas, workers and one Client on a
replica's URL, every job followed live; the master of the job stream's slot SIGKILLed, then
the master of a running request's log. Clients must follow the promoted replicas by
themselves: no subscriber's stream may raise (the driver counts every resume), a submit
through the same Client after each promotion must go through, and an ``mlx-worker stream``
process following a request across the kill must print its ``done``."""

from __future__ import annotations

# `mlx_redis_worker` must be imported before anything imports mlx: it loads OpenBLAS first.
import mlx_redis_worker  # noqa: F401  # isort: skip

import asyncio
import json
import time
from collections.abc import Coroutine
from typing import Any

from redis.crc import key_slot

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent
from mlx_redis_worker.local_redis import LocalCluster
from tests.reliability.faults_harness import Progress, run_stage
from tests.reliability.faults_scenarios import FaultConfig, stage_for, started, workers_for
from tests.support.drivers import DriverResult
from tests.support.environment import clean_environment
from tests.support.processes import WORKER_COMMAND


def run_cluster_failover(config: FaultConfig, cluster: LocalCluster | None = None) -> DriverResult:
    """Kill the job stream's master once a quarter of the requests ended, a log's master once
    half did; see the module docstring for what must hold."""
    directory = config.workdir()
    with started(cluster, LocalCluster, replicas=1) as cluster:
        # Workers, Client, CLI and the final checks all use a replica's URL: a node that
        # outlives both kills (node 0 may be a master that dies).
        url = cluster.replica_url()
        stage = stage_for(config, url)
        rids = [spec.rid for spec in stage.specs if spec.rid is not None]
        # The submit after each promotion: a prompt of the run, whose greedy text is known.
        prompt = stage.specs[0].prompt or ""
        reference = (prompt, stage.references[prompt])

        async def failovers(client: Client, progress: Progress) -> dict[str, Any]:
            # Both targets, and both `mlx-worker stream` followers, are chosen and started
            # before the first kill: a CLI's start is seconds of imports on a loaded machine,
            # and the requests would all end meanwhile. The second target is a log on another
            # shard than the job stream's (that shard has no replica left after its kill).
            owners = await asyncio.to_thread(cluster.slot_owners)
            stream_master = _owner(owners, client.keys.jobs)
            on_stream_master = [
                r for r in rids if _owner(owners, client.keys.log(r)) == stream_master
            ]
            elsewhere = [r for r in rids if _owner(owners, client.keys.log(r)) != stream_master]
            # The last requests queued are the likeliest still to be running at a kill.
            targets = [
                ("job stream", client.keys.jobs, on_stream_master[-1]),
                ("log", client.keys.log(elsewhere[-1]), elsewhere[-1]),
            ]
            followers = await asyncio.gather(*(_follow(url, config, rid) for _, _, rid in targets))
            kills: list[dict[str, Any]] = []
            endings: list[asyncio.Task[dict[str, Any]]] = []
            for index, ((what, key, _), follower) in enumerate(
                zip(targets, followers, strict=True)
            ):
                await progress.until_ended(progress.followed * (index + 1) // 4)
                done_at_kill = len(progress.ended)
                kill, ending = await _kill_and_follow(
                    cluster, client, config, key, follower, what, reference
                )
                kills.append({**kill, "done_at_kill": done_at_kill})
                endings.append(asyncio.create_task(ending))
            # The submits' jobs and the CLI's request end later: waited for only now, so the
            # second kill still comes while requests run.
            for kill, ending in zip(kills, endings, strict=True):
                kill.update(await ending)
            return {"kills": kills}

        stage.fault = failovers
        stage.workers += workers_for(config, url, directory)
        outcome = run_stage(stage, "Cluster 3+3: SIGKILL of two masters mid-run", directory)
    result, values = outcome.result, outcome.result.values
    if values["stream_exceptions_caught"] or values["stream_exceptions_escaped"]:
        result.problems.append(
            f"subscriber streams raised {values['stream_exceptions_caught']} times "
            f"({values['escaped']})"
        )
    for kill in values["kills"]:
        result.problems += kill["problems"]
    result.figures += [
        row
        for kill in values["kills"]
        for row in (
            (
                f"{kill['what']}'s master SIGKILLed with requests done",
                f"{kill['done_at_kill']} (port {kill['old_port']} -> {kill['new_port']})",
            ),
            (f"{kill['what']}: seconds to the replica's promotion", kill["promotion_seconds"]),
            (
                f"{kill['what']}: Client.submit after promotion: queued / done (s)",
                f"{kill['submit_seconds']} / {kill['done_seconds']}",
            ),
            (f"{kill['what']}: `mlx-worker stream` across the kill, exit", kill["cli_rc"]),
        )
    ]
    return result


def _owner(owners: dict[int, int], key: str) -> int:
    return owners[key_slot(key.encode())]


Follower = tuple[asyncio.subprocess.Process, bytes]


async def _follow(url: str, config: FaultConfig, rid: str) -> Follower:
    """An ``mlx-worker stream`` process following ``rid``, once it follows (its first line:
    the queued marker), not while it starts and connects."""
    cli = await asyncio.create_subprocess_exec(
        *WORKER_COMMAND,
        "stream",
        rid,
        "--redis-url",
        url,
        "--prefix",
        config.prefix,
        "--json",
        "--timeout",
        str(config.event_timeout),
        env=clean_environment(None),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert cli.stdout is not None
    return cli, await asyncio.wait_for(cli.stdout.readline(), 60)


async def _kill_and_follow(
    cluster: LocalCluster,
    client: Client,
    config: FaultConfig,
    key: str,
    follower: Follower,
    what: str,
    reference: tuple[str, str],
) -> tuple[dict[str, Any], Coroutine[Any, Any, dict[str, Any]]]:
    """SIGKILL ``key``'s master while ``follower`` follows a request, wait for the promotion,
    then submit through the same Client. Returns the figures so far, and what waits for the
    submitted job's and the CLI's ends."""
    cli, first_line = follower
    old_port = await asyncio.to_thread(cluster.kill_primary, key)
    killed_at = time.monotonic()
    new_port = await asyncio.to_thread(cluster.wait_promoted, key, old_port, 60.0)
    promotion_seconds = time.monotonic() - killed_at
    prompt, want = reference
    submitted_at = time.monotonic()
    submitted: str | None = None
    problems: list[str] = []
    try:
        submitted = await client.submit(prompt, max_tokens=config.max_tokens, temperature=0.0)
    except Exception as exc:
        problems.append(f"{what}: submit after promotion raised {type(exc).__name__}: {exc}")
    submit_seconds = round(time.monotonic() - submitted_at, 2)

    async def ending() -> dict[str, Any]:
        done_seconds = None
        if submitted is not None:
            try:
                end = await client.wait(submitted, timeout=config.event_timeout)
                done_seconds = round(time.monotonic() - submitted_at, 2)
                if not isinstance(end, DoneEvent) or end.output_text != want:
                    problems.append(f"{what}: the job submitted after promotion ended {end}")
            except Exception as exc:
                problems.append(f"{what}: its wait raised {type(exc).__name__}: {exc}")
        stdout, stderr = await cli.communicate()
        if cli.returncode != 0 or not _has_done((first_line + stdout).decode()):
            problems.append(
                f"{what}: mlx-worker stream exited {cli.returncode}: {stderr.decode()[-300:]}"
            )
        return {"done_seconds": done_seconds, "cli_rc": cli.returncode, "problems": problems}

    kill = {
        "what": what,
        "old_port": old_port,
        "new_port": new_port,
        "promotion_seconds": round(promotion_seconds, 2),
        "submit_seconds": submit_seconds if submitted is not None else None,
    }
    return kill, ending()


def _has_done(stdout: str) -> bool:
    for line in stdout.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("type") == "done":
            return True
    return False
