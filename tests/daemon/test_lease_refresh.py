"""A lane's lease refresh on a real redis-server: an entry another worker took is lost (logged
and dropped), an entry this worker acknowledged while the refresh was under way is not (no
``leases_lost`` warning for a job that finished)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import redis.asyncio as aioredis
import structlog

from mlx_redis_protocol.keys import Keys
from mlx_redis_worker.daemon.job_queue import Delivery, JobQueue
from mlx_redis_worker.daemon.lane import ModelLane
from tests.support.waiting import run


class Runner:
    """What the lane asks of its job runner here: the parked duplicates (none) and the
    entries it is told are lost."""

    def __init__(self) -> None:
        self.parked: dict[str, Any] = {}
        self.lost: list[list[str]] = []

    def lose_entries(self, entry_ids: list[str]) -> None:
        self.lost.append(list(entry_ids))


def test_only_entries_another_worker_took_are_lost(redis_url: str, prefix: str) -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url)
        stream = Keys(prefix).model_stream("m")
        queue = JobQueue(redis=client, stream=stream, consumer="w1", lease_ms=1000)
        try:
            await queue.ensure_group()
            for _ in range(2):
                await client.xadd(stream.stream, {"job": b"x"})
            delivered: list[Delivery] = await queue.read_new(2, 10)
            finished, taken = (d.entry_id for d in delivered)
            runner = Runner()
            lane = ModelLane(
                name="m",
                engine=cast(Any, None),
                queue=queue,
                runner=cast(Any, runner),
                max_concurrency=2,
                read_block_ms=10,
                backlog=list(delivered),
                stop=asyncio.Event(),
            )
            await queue.ack(finished)  # the job ended as the refresh went out
            await client.xclaim(stream.stream, stream.group, "w2", 0, [taken], justid=True)
            with structlog.testing.capture_logs() as logs:
                await lane.extend_leases()
            warned = [e["entries"] for e in logs if e["event"] == "leases_lost"]
            assert warned == [[taken]]
            assert runner.lost == [[taken]]
            assert queue.settled(finished) and not queue.settled(taken)
        finally:
            await client.aclose()

    run(main())
