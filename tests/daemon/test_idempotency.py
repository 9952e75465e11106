"""An idempotency window longer than the log: a finished request id is remembered.

A request that finished, whose log then expired, is queued again under the same id (a
producer's retry an hour later): it must not run again. The worker acknowledges the entry and
ends the new stream at once with ``error`` ``already_finished`` (attempt 0)."""

from __future__ import annotations

import pytest

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent, ErrorEvent, QueuedEvent
from tests.daemon.helpers import collect, settled
from tests.support.processes import WorkerFactory
from tests.support.waiting import run, until

LOG_TTL = 2


@pytest.mark.timeout(180)
def test_a_finished_request_queued_again_after_its_log_expired_does_not_run_again(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    workers.start("w1", env={"MLXW_LOG_TTL": str(LOG_TTL)})

    async def main() -> None:
        async with Client(redis_url, prefix=prefix, log_ttl=LOG_TTL) as client:
            rid = await client.submit("Once only", request_id="pay-1", max_tokens=8)
            first = await collect(client, rid)
            assert isinstance(first[-1], DoneEvent)
            # The marker is set after the terminal event is logged, before the ack.
            await until(lambda: settled(client), 10, "the first entry acknowledged")
            finished = client.keys.finished(rid)
            assert 86400 - 60 <= await client.redis.ttl(finished) <= 86400
            log_key = client.keys.log(rid)
            await until(lambda: _gone(client, log_key), LOG_TTL + 10, "the first run's log expired")

            await client.submit("Once only", request_id=rid, max_tokens=8)
            again = await collect(client, rid)
            assert [type(e) for e in again] == [QueuedEvent, ErrorEvent], again
            error = again[-1]
            assert isinstance(error, ErrorEvent)
            assert (error.code, error.seq, error.attempt) == ("already_finished", 1, 0)
            assert "not run again" in error.message
            await until(lambda: settled(client), 10, "the second entry acknowledged")
            (reply,) = await client.stats()
            assert reply.result["jobs"]["outcomes"] == {"completed": 1, "already_done": 1}

    run(main())


async def _gone(client: Client, key: str) -> bool:
    return not await client.redis.exists(key)
