"""A live fair-share worker whose fair-share keys an operator deletes or breaks while jobs
wait for a pick (issue 39): every job still runs once, and the worker says what it repaired.
The tiny model, one slot, a real redis-server."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import DoneEvent
from mlx_redis_worker.daemon.fair_queue import FAIR_CONSUMER
from tests.fairness.test_flood import FAIR
from tests.support.processes import MODEL, WorkerFactory
from tests.support.waiting import run, wait_until

JOBS = 9


def waiting_for_a_pick(admin: redis.Redis, keys: Keys) -> int:
    stream = keys.model_stream(MODEL)
    summary: Any = admin.xpending(stream.stream, stream.group)
    return sum(
        int(c["pending"]) for c in summary["consumers"] if c["name"].decode() == FAIR_CONSUMER
    )


@pytest.mark.timeout(300)
def test_jobs_waiting_for_a_pick_survive_an_operators_cleanup(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    keys = Keys(prefix)
    fair = keys.fair(MODEL)
    admin = redis.Redis.from_url(redis_url)
    worker = workers.start("w1", max_concurrency=1, env=FAIR)

    async def queue() -> list[str]:
        async with Client(redis_url, prefix=prefix) as client:
            return [
                await client.submit(f"job {i}", max_tokens=64, tenant="a" if i % 3 else "b")
                for i in range(JOBS)
            ]

    rids = run(queue())
    wait_until(lambda: waiting_for_a_pick(admin, keys) >= 3, 60, "jobs waiting for a pick")
    admin.delete(fair.queue("a"), fair.ages("a"), fair.queue("b"), fair.backlogged)
    admin.hset(fair.state, "vtime", "hello")
    admin.hset(fair.weights, "b", "inf")

    async def finish() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            for rid in rids:
                assert isinstance(await client.wait(rid, timeout=120), DoneEvent)

    run(finish())
    wait_until(lambda: waiting_for_a_pick(admin, keys) == 0, 30, "nothing left waiting")
    repaired = {
        event["key"]
        for event in worker.log_events()
        if event.get("event") == "fair_share_key_repaired"
    }
    assert f"{fair.state} vtime" in repaired
    admin.close()
