"""A worker's activity key: the requests it generates with their live token counts, and its
tokens per time bucket (what the gateway's status page plots), gone when the worker stops."""

from __future__ import annotations

import json
from collections.abc import Awaitable

import pytest
import redis

from mlx_redis_protocol.activity import Activity, RequestActivity, decode_activity
from mlx_redis_protocol.client import Client
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import DoneEvent
from mlx_redis_worker.daemon.activity import TokenHistory
from tests.support.processes import WorkerFactory
from tests.support.waiting import run, until


def test_token_history_adds_up_per_aligned_bucket_and_forgets_old_ones() -> None:
    history = TokenHistory(bucket_seconds=2, history_seconds=10)
    history.add(3, now=100.5)
    history.add(4, now=101.9)  # same bucket [100, 102)
    history.add(5, now=102.0)
    history.add(0, now=103.0)  # nothing to count
    assert history.buckets(now=103.0) == ((100, 7), (102, 5))
    # Ten seconds later the window (five buckets, the current one included) starts at 104.
    history.add(1, now=112.5)
    assert history.buckets(now=112.5) == ((112, 1),)


def test_activity_round_trips_and_reads_bad_entries_as_absent() -> None:
    activity = Activity(
        worker_id="w1",
        at=12.5,
        bucket_seconds=2,
        buckets=((10, 4),),
        requests=(RequestActivity("r1", "tiny", 1, 7, 11.0),),
    )
    assert decode_activity(activity.encode()) == activity
    hostile = json.dumps(
        {
            "worker_id": "w1",
            "bucket_seconds": 2,
            "buckets": [[1, 2], ["x", 1], [3]],
            "requests": [{"request_id": "bad id {}"}, {"request_id": "ok", "tokens": "many"}],
        }
    )
    decoded = decode_activity(hostile)
    assert decoded is not None
    assert decoded.buckets == ((1, 2),)
    assert [(r.request_id, r.tokens) for r in decoded.requests] == [("ok", 0)]
    assert decode_activity(b"not json") is None
    assert decode_activity(json.dumps({"worker_id": "w", "bucket_seconds": 0})) is None


def test_a_worker_advertises_running_requests_with_growing_token_counts(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    worker = workers.start("active")

    async def scenario() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            key = client.keys.activity(worker.worker_id)

            async def tokens_of(request_id: str) -> int | None:
                activity = decode_activity(await client.redis.get(key))
                if activity is None:
                    return None
                return next(
                    (r.tokens for r in activity.requests if r.request_id == request_id), None
                )

            # Greedy, so that no sampled EOS ends it early: seconds of generation, many activity
            # writes (every 0.2 s in tests).
            rid = await client.submit("a long story", max_tokens=300, temperature=0.0, model="tiny")
            first = await until(lambda: tokens_of(rid), 30, "the request in the activity key")
            later = await until(
                lambda: _above(tokens_of(rid), first), 30, "its token count to grow"
            )
            assert later > first
            end = await client.wait(rid, timeout=60)
            assert isinstance(end, DoneEvent)
            assert end.usage.completion_tokens == 300
            activity = await until(
                lambda: _without(client, key, rid), 10, "the finished request to leave it"
            )
            assert activity.worker_id == worker.worker_id
            assert sum(tokens for _, tokens in activity.buckets) >= end.usage.completion_tokens
        assert worker.stop() == 0
        async with Client(redis_url, prefix=prefix) as client:
            assert not await client.redis.exists(key)

    run(scenario())


async def _above(count: Awaitable[int | None], floor: int) -> int | None:
    value = await count
    return value if value is not None and value > floor else None


async def _without(client: Client, key: str, request_id: str) -> Activity | None:
    activity = decode_activity(await client.redis.get(key))
    if activity is None or any(r.request_id == request_id for r in activity.requests):
        return None
    return activity


@pytest.mark.timeout(120)
def test_an_idle_worker_writes_its_activity_once_per_heartbeat(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    """Unchanged activity is rewritten with the heartbeat's rhythm, not every
    activity_interval: over ten heartbeats of an idle worker (every 0.5 s in tests, activity
    every 0.2 s), at most one activity write per heartbeat, where there were two or three."""
    worker = workers.start("idle")
    keys = Keys(prefix)
    beat, active = keys.worker(worker.worker_id), keys.activity(worker.worker_id)
    # No socket timeout: a read that times out drops the connection, and MONITOR with it.
    client = redis.Redis.from_url(redis_url, socket_timeout=None)
    writes = {beat: 0, active: 0}
    with client.monitor() as monitor:
        while writes[beat] < 11:
            words = str(monitor.next_command()["command"]).split()
            if len(words) > 1 and words[0].upper() == "SET" and words[1] in writes:
                writes[words[1]] += 1
    client.close()
    # From the first heartbeat seen to the eleventh: ten intervals, at most one write each
    # (and one for a change, such as a token bucket leaving the window).
    assert 1 <= writes[active] <= 12, writes
