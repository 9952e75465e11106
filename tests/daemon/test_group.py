"""Consumers of stopped workers leave the group; the dead-letter stream stays bounded.

A worker that stops cleanly removes its consumer; one killed while holding a job keeps it, and
``mlx-worker group prune`` removes only consumers with nothing pending, idle long enough and no
live heartbeat. A worker is a consumer in the group of each stream it reads (the default stream,
which it forwards, and its model's, where jobs run), each judged on its own. Against the real
redis-server and the real worker process.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from typing import Any

import pytest
import redis

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.connection import connect
from mlx_redis_protocol.group import list_consumers, remove_idle_consumer
from mlx_redis_protocol.keys import JobStream, Keys
from mlx_redis_protocol.messages import DoneEvent
from mlx_redis_worker.daemon.job_queue import JobQueue
from mlx_redis_worker.local_redis import LocalCluster
from tests.daemon.helpers import check_stream, collect
from tests.support.fleet import write_heartbeat
from tests.support.processes import MODEL, WorkerFactory, mlx_worker
from tests.support.waiting import run, wait_until


def mlx_worker_group(redis_url: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    return mlx_worker("group", *args, "--redis-url", redis_url, "--prefix", prefix, timeout=60)


def json_rows(completed: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert completed.returncode == 0, completed.stderr
    return [json.loads(line) for line in completed.stdout.splitlines()]


def consumer_names(redis_url: str, stream: JobStream) -> list[str]:
    """The consumers of the stream's group."""
    client = redis.Redis.from_url(redis_url)
    try:
        return [row["name"].decode() for row in client.xinfo_consumers(stream.stream, stream.group)]
    finally:
        client.close()


@pytest.mark.timeout(120)
def test_a_clean_stop_removes_the_workers_consumer(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    """The worker leaves the group of both streams it reads."""
    keys = Keys(prefix)
    streams = (keys.default_stream, keys.model_stream(MODEL))
    worker = workers.start("leaves")

    async def serve_one() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            request_id = await client.submit("one job", max_tokens=6, temperature=0.0)
            summary = check_stream(await collect(client, request_id), request_id)
            assert isinstance(summary.terminal, DoneEvent)

    run(serve_one())
    for stream in streams:
        assert consumer_names(redis_url, stream) == ["leaves"], stream
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0, worker.log_tail()
    for stream in streams:
        assert consumer_names(redis_url, stream) == [], stream
    removed = [e.get("stream") for e in worker.log_events() if e.get("event") == "consumer_removed"]
    assert sorted(removed) == sorted(stream.stream for stream in streams)


@pytest.mark.timeout(180)
def test_a_killed_worker_holding_a_job_keeps_its_consumer_and_prune_spares_it(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    """SIGKILL while a job runs: the consumer keeps the pending job, so `group prune` (any
    idle time, heartbeat long gone) must not remove it, whereas an idle consumer with nothing
    pending beside it goes. `--dry-run` removes nothing.

    The job is pending on the model's stream; the killed worker's consumer of the default
    stream (which it only forwards from) holds nothing, so prune removes that one."""
    keys = Keys(prefix)
    default, model = keys.default_stream, keys.model_stream(MODEL)
    worker = workers.start("killed", lease_seconds=600)

    async def submit_long() -> str:
        async with Client(redis_url, prefix=prefix) as client:
            request_id = await client.submit("a long one", max_tokens=2000, temperature=0.0)
            # Running: its first delta is in the log.
            while await client.redis.xlen(keys.log(request_id)) < 3:
                await asyncio.sleep(0.05)
            # A consumer that read nothing it still holds: the one prune may remove.
            await client.redis.xreadgroup(model.group, "ghost", {model.stream: "0"}, count=1)
            return request_id

    run(submit_long())
    worker.kill()
    wait_until(lambda: not worker.heartbeat_alive(), 10, "the heartbeat to expire")

    listed = {
        (row["name"], row["stream"]): row
        for row in json_rows(mlx_worker_group(redis_url, prefix, "list", "--json"))
    }
    assert set(listed) == {
        ("killed", default.stream),
        ("killed", model.stream),
        ("ghost", model.stream),
    }
    killed_default, killed_model = listed["killed", default.stream], listed["killed", model.stream]
    ghost = listed["ghost", model.stream]
    assert (killed_model["pending"], killed_model["heartbeat"]) == (1, False)
    assert (killed_default["pending"], killed_default["heartbeat"]) == (0, False)
    assert (ghost["pending"], ghost["heartbeat"]) == (0, False)
    assert (killed_model["model"], ghost["model"], killed_default["model"]) == (MODEL, MODEL, None)

    dry = json_rows(
        mlx_worker_group(redis_url, prefix, "prune", "--idle", "0", "--dry-run", "--json")
    )
    assert sorted((row["name"], row["stream"], row["action"]) for row in dry) == [
        ("ghost", model.stream, "would remove"),
        ("killed", default.stream, "would remove"),
    ]
    assert sorted(consumer_names(redis_url, model)) == ["ghost", "killed"]
    assert consumer_names(redis_url, default) == ["killed"]

    # The default idle time (an hour) spares all: they were active a moment ago.
    assert json_rows(mlx_worker_group(redis_url, prefix, "prune", "--json")) == []

    pruned = mlx_worker_group(redis_url, prefix, "prune", "--idle", "0")
    assert pruned.returncode == 0, pruned.stderr
    assert sorted(pruned.stdout.splitlines()) == [
        f"removed ghost from {model.stream}",
        f"removed killed from {default.stream}",
    ]
    assert consumer_names(redis_url, model) == ["killed"]
    assert consumer_names(redis_url, default) == []

    table = mlx_worker_group(redis_url, prefix, "list")
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()
    assert header.split() == ["CONSUMER", "PENDING", "IDLE_S", "HEARTBEAT", "STREAM"]
    assert row.split()[0:2] == ["killed", "1"] and row.split()[3:] == ["none", model.stream]


def test_prune_spares_a_consumer_with_a_live_heartbeat(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    jobs = keys.model_stream(MODEL)

    async def prepare() -> None:
        client = await connect(redis_url)
        try:
            await client.xgroup_create(jobs.stream, jobs.group, id="0", mkstream=True)
            for name in ("alive", "gone"):
                await client.xreadgroup(jobs.group, name, {jobs.stream: "0"}, count=1)
            # A live worker of the model: its heartbeat, and the registry names the model
            await write_heartbeat(client, keys, "alive", b"{}", [MODEL])
        finally:
            await client.aclose()

    run(prepare())
    rows = json_rows(mlx_worker_group(redis_url, prefix, "prune", "--idle", "0", "--json"))
    assert [(row["name"], row["stream"], row["action"]) for row in rows] == [
        ("gone", jobs.stream, "removed")
    ]
    assert consumer_names(redis_url, jobs) == ["alive"]


def test_the_removal_script_keeps_a_consumer_with_pending_entries(
    redis_url: str, prefix: str
) -> None:
    keys = Keys(prefix)
    jobs = keys.model_stream(MODEL)

    async def main() -> None:
        client = await connect(redis_url)
        try:
            await client.xgroup_create(jobs.stream, jobs.group, id="0", mkstream=True)
            entry = await client.xadd(jobs.stream, {"job": b"x"})
            await client.xreadgroup(jobs.group, "holder", {jobs.stream: ">"}, count=1)
            assert not await remove_idle_consumer(client, jobs, "holder")
            consumers = await list_consumers(client, keys, jobs)
            assert [(c.name, c.pending, c.stream) for c in consumers] == [("holder", 1, jobs)]
            await client.xack(jobs.stream, jobs.group, entry)
            assert await remove_idle_consumer(client, jobs, "holder")
            assert await list_consumers(client, keys, jobs) == []
        finally:
            await client.aclose()

    run(main())


def test_group_verbs_without_a_group_are_a_usage_error(redis_url: str, prefix: str) -> None:
    completed = mlx_worker_group(redis_url, prefix, "list")
    assert completed.returncode == 2
    assert completed.stderr.splitlines() == [
        f"mlx-worker: no consumer group '{prefix}' on {prefix}:jobs (has a worker with prefix "
        f"'{prefix}' ever started?)"
    ]


@pytest.mark.parametrize(("maxlen", "bound"), [(50, 150), (10_000, None)])
def test_the_dead_letter_stream_is_trimmed_to_about_maxlen(
    redis_url: str, prefix: str, maxlen: int, bound: int | None
) -> None:
    """300 dead letters: with MAXLEN ~ 50 Redis trims whole nodes of 100 entries, so the
    stream holds at least 50 and fewer than 150, the newest ones; with the default all stay."""
    jobs = Keys(prefix).model_stream(MODEL)
    letters = 300

    async def main() -> None:
        client = await connect(redis_url)
        try:
            queue = JobQueue(
                redis=client,
                stream=jobs,
                consumer="dlq",
                lease_ms=60_000,
                dead_letter_maxlen=maxlen,
            )
            await queue.ensure_group()
            for i in range(letters):
                await client.xadd(jobs.stream, {"job": f"bad {i}".encode()})
            deliveries = await queue.read_new(letters, block_ms=100)
            assert len(deliveries) == letters
            for delivery in deliveries:
                moved = await queue.dead_letter(delivery, "malformed", "not msgpack", None)
                assert moved
            length = await client.xlen(jobs.dead)
            if bound is None:
                assert length == letters
            else:
                assert maxlen <= length < bound, length
            newest = await client.xrevrange(jobs.dead, "+", "-", count=1)
            assert newest[0][1][b"entry_id"].decode() == deliveries[-1].entry_id
            assert await client.xlen(jobs.stream) == 0
        finally:
            await client.aclose()

    run(main())


def test_dead_letter_maxlen_must_be_positive(redis_url: str) -> None:
    async def main() -> None:
        client = await connect(redis_url)
        try:
            with pytest.raises(ValueError, match="dead_letter_maxlen must be > 0"):
                JobQueue(
                    redis=client,
                    stream=Keys("x").default_stream,
                    consumer="c",
                    lease_ms=1000,
                    dead_letter_maxlen=0,
                )
        finally:
            await client.aclose()

    run(main())


@pytest.mark.timeout(120)
def test_list_and_prune_on_a_cluster(redis_cluster: LocalCluster, prefix: str) -> None:
    """Heartbeat keys live in other slots than the job streams: the lookups go to their nodes,
    and the removal script runs on each job stream's. The consumers are in the groups of both
    streams a worker reads (the default stream and its model's, in slots of their own); the
    job is pending on the model's."""
    keys = Keys(prefix)
    default, model = keys.default_stream, keys.model_stream(MODEL)

    async def prepare() -> None:
        client = await connect(redis_cluster.url)
        try:
            for jobs in (default, model):
                await client.xgroup_create(jobs.stream, jobs.group, id="0", mkstream=True)
            await client.xadd(model.stream, {"job": b"x"})
            await client.xreadgroup(model.group, "holder", {model.stream: ">"}, count=1)
            for jobs in (default, model):
                for name in ("alive", "gone"):
                    await client.xreadgroup(jobs.group, name, {jobs.stream: "0"}, count=1)
            # A live worker of the model: its heartbeat, and the registry names the model
            await write_heartbeat(client, keys, "alive", b"{}", [MODEL])
        finally:
            await client.aclose()

    run(prepare())
    listed = json_rows(mlx_worker_group(redis_cluster.url, prefix, "list", "--json"))
    assert sorted((r["name"], r["stream"], r["pending"], r["heartbeat"]) for r in listed) == [
        ("alive", default.stream, 0, True),
        ("alive", model.stream, 0, True),
        ("gone", default.stream, 0, False),
        ("gone", model.stream, 0, False),
        ("holder", model.stream, 1, False),
    ]
    pruned = json_rows(
        mlx_worker_group(redis_cluster.url, prefix, "prune", "--idle", "0", "--json")
    )
    assert sorted((r["name"], r["stream"], r["action"]) for r in pruned) == [
        ("gone", default.stream, "removed"),
        ("gone", model.stream, "removed"),
    ]
    listed = json_rows(mlx_worker_group(redis_cluster.url, prefix, "list", "--json"))
    assert sorted((r["name"], r["stream"]) for r in listed) == [
        ("alive", default.stream),
        ("alive", model.stream),
        ("holder", model.stream),
    ]
