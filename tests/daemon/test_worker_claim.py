"""Two live workers never share one worker id (``mlxw:claim:{worker_id}``).

Before the claim, two workers started from the same directory without ``--worker-id`` got the
same id, read each other's pending jobs as their own, and one's clean stop removed the other's
consumers. Now the second refuses to start (exit status 3, one line naming the holder), a
worker restarted after ``kill -9`` takes its id and its pending jobs back at once, and a clean
stop deletes only its own claim. Against real redis-server and real worker processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket

import pytest
import redis
from redis.exceptions import OutOfMemoryError

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.connection import connect
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import DoneEvent
from mlx_redis_worker.daemon.claim import EXIT_ID_HELD, Renewed, WorkerClaim, WorkerIdHeld
from mlx_redis_worker.local_redis import RedisServer
from tests.daemon.helpers import check_stream, collect
from tests.support.processes import MODEL, WorkerFactory
from tests.support.waiting import run


def consumers(redis_url: str, stream: str, group: str) -> dict[str, int]:
    client = redis.Redis.from_url(redis_url)
    try:
        return {
            row["name"].decode(): row["pending"] for row in client.xinfo_consumers(stream, group)
        }
    finally:
        client.close()


def claim_value(redis_url: str, keys: Keys, worker_id: str) -> dict[str, object] | None:
    client = redis.Redis.from_url(redis_url)
    try:
        raw = client.get(keys.claim(worker_id))
    finally:
        client.close()
    return None if raw is None else dict(json.loads(raw))


@pytest.mark.timeout(180)
def test_a_second_worker_under_a_live_id_refuses_and_the_first_keeps_serving(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    keys = Keys(prefix)
    stream = keys.model_stream(MODEL)
    first = workers.start("twin", lease_seconds=600)

    async def submit_long() -> str:
        async with Client(redis_url, prefix=prefix) as client:
            request_id = await client.submit("a long one", max_tokens=400, temperature=0.0)
            while await client.redis.xlen(keys.log(request_id)) < 3:  # running
                await asyncio.sleep(0.05)
            return request_id

    request_id = run(submit_long())
    second = workers.start("twin", lease_seconds=600, wait=False)
    assert second.wait(90) == EXIT_ID_HELD, second.log_tail()
    refusal = second.log_text().splitlines()[-1]
    assert refusal.startswith("mlx-worker: worker id 'twin' is held by a live worker: ")
    assert f"pid {first.pid} on host {socket.gethostname()!r}" in refusal

    # The refused worker took nothing of the first's: its claim, its consumer and pending job.
    holder = claim_value(redis_url, keys, "twin")
    assert holder is not None and holder["pid"] == first.pid
    assert consumers(redis_url, stream.stream, stream.group) == {"twin": 1}
    first.check_running()

    async def finish() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            summary = check_stream(await collect(client, request_id, timeout=120), request_id)
            assert isinstance(summary.terminal, DoneEvent)
            assert summary.resets == []  # ran once, on the first worker

    run(finish())
    # A clean stop releases its own claim: the id is free for the next worker.
    assert first.stop() == 0, first.log_tail()
    assert claim_value(redis_url, keys, "twin") is None


@pytest.mark.timeout(180)
def test_a_worker_restarted_after_kill_takes_its_id_and_pending_job_back(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    """The dead process's claim has not expired (TTL far off), but it names this host and a
    pid that is gone: the restart takes it over at once and runs its own pending job, which
    no other worker could reclaim (the lease is 600 s)."""
    keys = Keys(prefix)
    worker = workers.start("phoenix", lease_seconds=600, env={"MLXW_HEARTBEAT_TTL": "600"})

    async def submit_long() -> str:
        async with Client(redis_url, prefix=prefix) as client:
            request_id = await client.submit("a long one", max_tokens=400, temperature=0.0)
            while await client.redis.xlen(keys.log(request_id)) < 3:
                await asyncio.sleep(0.05)
            return request_id

    request_id = run(submit_long())
    dead_pid = worker.pid
    worker.kill()
    held = claim_value(redis_url, keys, "phoenix")
    assert held is not None and held["pid"] == dead_pid

    worker.start().wait_ready()
    taken = [e for e in worker.log_events() if e.get("event") == "worker_id_taken_over"]
    assert len(taken) == 1 and f"pid {dead_pid} " in str(taken[0]["holder"])

    async def finish() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            events = await collect(client, request_id, timeout=120)
            summary = check_stream(events, request_id)
            assert isinstance(summary.terminal, DoneEvent)
            assert len(summary.resets) == 1  # the restart ran it again

    run(finish())
    assert worker.stop() == 0, worker.log_tail()


def test_a_claim_is_released_and_renewed_only_by_its_holder(redis_url: str, prefix: str) -> None:
    """Compare and delete: a worker whose claim another took over deletes nothing of it, and
    its renewal says the id is held; a live holder on another host is never taken over."""
    keys = Keys(prefix)

    async def main() -> None:
        client = await connect(redis_url)
        try:
            old = WorkerClaim(redis=client, keys=keys, worker_id="w", ttl_ms=60_000)
            new = WorkerClaim(redis=client, keys=keys, worker_id="w", ttl_ms=60_000)
            await old.acquire()
            await old.acquire()  # its own: renewed
            # Same host, same pid (a restarted container): the old one is dead, taken over.
            await new.acquire()
            with pytest.raises(WorkerIdHeld, match=f"pid {os.getpid()} on host"):
                await old.renew()
            assert not await old.release()
            assert await client.get(keys.claim("w")) == new.value.encode()

            # A holder on another host: its pid tells nothing here, it waits for the TTL.
            elsewhere = {"token": "t", "host": "another-host", "pid": 1, "started_at": 0}
            await client.set(keys.claim("x"), json.dumps(elsewhere), px=60_000)
            with pytest.raises(WorkerIdHeld, match="pid 1 on host 'another-host'"):
                await WorkerClaim(redis=client, keys=keys, worker_id="x", ttl_ms=60_000).acquire()
            assert await new.release()
            assert await client.exists(keys.claim("w")) == 0
        finally:
            await client.aclose()

    run(main())


def test_a_renewal_writes_the_workers_keys_only_while_the_claim_is_its_own(
    redis_url: str, prefix: str
) -> None:
    """A heartbeat is one command: the claim renewed, the heartbeat and the activity written
    with it (one slot, the id's). A worker whose id another took writes neither."""
    keys = Keys(prefix)
    beat, active = keys.worker("b"), keys.activity("b")

    async def main() -> None:
        client = await connect(redis_url)
        try:
            claim = WorkerClaim(redis=client, keys=keys, worker_id="b", ttl_ms=60_000)
            await claim.acquire()
            first = await claim.renew([(beat, b"beat 1"), (active, b"activity 1")])
            assert first == Renewed(written=True, existed=False)
            again = await claim.renew([(beat, b"beat 2"), (active, b"activity 2")])
            assert again == Renewed(written=True, existed=True)
            assert await client.mget(beat, active) == [b"beat 2", b"activity 2"]
            assert 50_000 < await client.pttl(active) <= 60_000

            elsewhere = {"token": "t", "host": "another-host", "pid": 1, "started_at": 0}
            await client.set(keys.claim("b"), json.dumps(elsewhere), px=60_000)
            with pytest.raises(WorkerIdHeld, match="another-host"):
                await claim.renew([(beat, b"beat 3"), (active, b"activity 3")])
            assert await client.mget(beat, active) == [b"beat 2", b"activity 2"]
        finally:
            await client.aclose()

    run(main())


def test_a_full_redis_keeps_the_last_heartbeat_alive() -> None:
    """Under ``noeviction`` past ``maxmemory`` Redis refuses writes but not new TTLs: the
    renewal keeps the claim, heartbeat and activity alive (a live worker does not look dead
    while memory is freed), and says the heartbeat was not written; with no heartbeat to
    keep, it is an OOM error."""
    keys = Keys("oom")
    beat, active = keys.worker("f"), keys.activity("f")

    async def main(url: str) -> None:
        client = await connect(url)
        try:
            claim = WorkerClaim(redis=client, keys=keys, worker_id="f", ttl_ms=60_000)
            await claim.acquire()
            await claim.renew([(beat, b"beat 1"), (active, b"activity 1")])
            for key in (keys.claim("f"), beat, active):
                await client.pexpire(key, 2_000)
            await client.config_set("maxmemory-policy", "noeviction")
            await client.config_set("maxmemory", 1)
            kept = await claim.renew([(beat, b"beat 2"), (active, b"activity 2")])
            assert kept == Renewed(written=False, existed=True)
            assert await client.mget(beat, active) == [b"beat 1", b"activity 1"]
            for key in (keys.claim("f"), beat, active):
                assert await client.pttl(key) > 50_000
            with pytest.raises(OutOfMemoryError):
                await claim.renew([(keys.worker("g"), b"beat"), (keys.activity("g"), b"a")])
        finally:
            await client.aclose()

    with RedisServer() as server:
        run(main(server.url))
