"""The fair pick script on a real redis-server, without a model: which waiting job a freed
slot gets, by tenant, weight, priority and age; and what the consumer group sees."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import redis.asyncio as aioredis

from mlx_redis_protocol.fair_share import served_bucket
from mlx_redis_protocol.keys import Keys
from mlx_redis_worker.daemon.fair_queue import (
    FAIR_CONSUMER,
    INTAKE,
    INTAKE_WHILE_BUSY,
    FairQueue,
)
from mlx_redis_worker.daemon.job_queue import JobQueue


def job(request_id: str, tenant: str | None = None, **fields: Any) -> bytes:
    body: dict[str, Any] = {"v": 1, "request_id": request_id, "prompt": "hi", **fields}
    if tenant is not None:
        body["tenant"] = tenant
    data: bytes = msgpack.packb(body)
    return data


class Fleet:
    """One model's stream and fair queues, as ``workers`` worker ids see them."""

    def __init__(self, client: aioredis.Redis, prefix: str, age_bound: float = 30.0) -> None:
        self.keys = Keys(prefix)
        self.stream = self.keys.model_stream("m")
        self.client = client
        self.age_bound = age_bound
        self.clock_ms = 1_000_000

    def fair(self, worker: str) -> FairQueue:
        return FairQueue(
            redis=self.client,
            stream=self.stream,
            keys=self.keys.fair("m"),
            consumer=worker,
            tenant_weights_key=self.keys.tenant_weights,
            age_bound_seconds=self.age_bound,
        )

    def queue(self, worker: str) -> JobQueue:
        return JobQueue(redis=self.client, stream=self.stream, consumer=worker, lease_ms=1000)

    async def add(self, request_id: str, tenant: str | None = None, **fields: Any) -> str:
        """Queue a job at the simulated clock (its entry id's time), 1 ms after the last."""
        self.clock_ms += 1
        entry_id: Any = await self.client.xadd(
            self.stream.stream, {"job": job(request_id, tenant, **fields)}, id=f"{self.clock_ms}-0"
        )
        return str(entry_id.decode())


def run(redis_url: str, prefix: str, scenario: Callable[[Fleet], Awaitable[None]]) -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url)
        fleet = Fleet(client, prefix)
        await fleet.queue("w1").ensure_group()
        try:
            await scenario(fleet)
        finally:
            await client.aclose()

    asyncio.run(main())


def _bucket_now() -> int:
    return served_bucket(time.time())


def request_ids(picked: Any) -> list[str]:
    return [msgpack.unpackb(d.job_bytes)["request_id"] for d in picked.deliveries]


def test_a_late_tenant_is_served_before_the_rest_of_a_flood(redis_url: str, prefix: str) -> None:
    run(redis_url, prefix, _test_a_late_tenant_is_served_before_the_rest_of_a_flood)


async def _test_a_late_tenant_is_served_before_the_rest_of_a_flood(fleet: Fleet) -> None:
    for i in range(40):
        await fleet.add(f"a{i}", "team-a", max_tokens=400)
    fair = fleet.fair("w1")
    first = await fair.pick(2, now_ms=fleet.clock_ms)
    assert request_ids(first) == ["a0", "a1"]
    await fleet.add("b0", "team-b", max_tokens=8)
    # The next free slot goes to team-b, although 38 jobs of team-a queued first.
    assert request_ids(await fair.pick(1, now_ms=fleet.clock_ms)) == ["b0"]
    assert request_ids(await fair.pick(1, now_ms=fleet.clock_ms)) == ["a2"]


def test_picked_jobs_are_pending_for_the_worker_once_delivered(redis_url: str, prefix: str) -> None:
    run(redis_url, prefix, _test_picked_jobs_are_pending_for_the_worker_once_delivered)


async def _test_picked_jobs_are_pending_for_the_worker_once_delivered(fleet: Fleet) -> None:
    entry = await fleet.add("r1", "t1")
    await fleet.add("r2", "t1")
    picked = await fleet.fair("w1").pick(1, now_ms=fleet.clock_ms)
    assert [d.entry_id for d in picked.deliveries] == [entry]
    assert picked.deliveries[0].times_delivered == 1
    mine = await fleet.client.xpending_range(
        fleet.stream.stream, fleet.stream.group, "-", "+", 10, consumername="w1"
    )
    assert [(m["message_id"].decode(), m["times_delivered"]) for m in mine] == [(entry, 1)]
    waiting = await fleet.client.xpending_range(
        fleet.stream.stream, fleet.stream.group, "-", "+", 10, consumername=FAIR_CONSUMER
    )
    assert len(waiting) == 1  # r2 waits for a pick, pending for the fair queue
    # A reclaim leaves the waiting job alone (idle by design), however long it waits.
    await fleet.client.xclaim(
        fleet.stream.stream,
        fleet.stream.group,
        FAIR_CONSUMER,
        0,
        [waiting[0]["message_id"]],
        idle=3_600_000,
        justid=True,
    )
    assert await fleet.queue("w2").reclaim_except(FAIR_CONSUMER, 10) == []


def test_reclaim_takes_a_dead_workers_picked_job(redis_url: str, prefix: str) -> None:
    run(redis_url, prefix, _test_reclaim_takes_a_dead_workers_picked_job)


async def _test_reclaim_takes_a_dead_workers_picked_job(fleet: Fleet) -> None:
    entry = await fleet.add("r1", "t1")
    await fleet.fair("dead").pick(1, now_ms=fleet.clock_ms)
    await fleet.client.xclaim(
        fleet.stream.stream, fleet.stream.group, "dead", 0, [entry], idle=5000, justid=True
    )
    taken = await fleet.queue("w2").reclaim_except(FAIR_CONSUMER, 10)
    assert [(d.entry_id, d.times_delivered) for d in taken] == [(entry, 2)]


def test_priorities_within_a_tenant_and_the_age_bound(redis_url: str, prefix: str) -> None:
    run(redis_url, prefix, _test_priorities_within_a_tenant_and_the_age_bound)


async def _test_priorities_within_a_tenant_and_the_age_bound(fleet: Fleet) -> None:
    fleet.age_bound = 1.0
    await fleet.add("batch", "t1", priority=10)
    await fleet.add("urgent", "t1", priority=-5)
    await fleet.add("normal", "t1")
    fair = fleet.fair("w1")
    assert request_ids(await fair.pick(1, now_ms=fleet.clock_ms)) == ["urgent"]
    await fleet.add("urgent2", "t1", priority=-5)
    # Past the age bound, the oldest waiting job goes first whatever its priority.
    assert request_ids(await fair.pick(1, now_ms=fleet.clock_ms + 1000)) == ["batch"]
    assert request_ids(await fair.pick(2, now_ms=fleet.clock_ms)) == ["urgent2", "normal"]


def test_jobs_of_one_priority_go_in_their_order_of_arrival(redis_url: str, prefix: str) -> None:
    run(redis_url, prefix, _test_jobs_of_one_priority_go_in_their_order_of_arrival)


async def _test_jobs_of_one_priority_go_in_their_order_of_arrival(fleet: Fleet) -> None:
    """Entries of one millisecond (a pipelined producer, the default stream's forwarding)
    and ids of more digits: arrival order, not the ids' order as text ('…-10' < '…-2')."""
    ids = [f"999999-{seq}" for seq in range(12)] + ["1000000-0", "1000000-1"]
    for index, entry_id in enumerate(ids):
        await fleet.client.xadd(fleet.stream.stream, {"job": job(f"r{index}", "t1")}, id=entry_id)
    picked = await fleet.fair("w1").pick(len(ids), now_ms=1_000_001)
    assert [d.entry_id for d in picked.deliveries] == ids
    # An entry queued by a worker before padding (its member the bare id) is still picked.
    fair_keys = fleet.keys.fair("m")
    await fleet.client.xadd(fleet.stream.stream, {"job": job("old", "t1")}, id="1000001-0")
    await fleet.client.xreadgroup(
        fleet.stream.group, FAIR_CONSUMER, {fleet.stream.stream: ">"}, count=1
    )
    await fleet.client.zadd(fair_keys.queue("t1"), {"1000001-0": 0})
    await fleet.client.zadd(fair_keys.backlogged, {"t1": 0})
    assert request_ids(await fleet.fair("w1").pick(1, now_ms=1_000_002)) == ["old"]


def test_weights_from_the_fleet_setting(redis_url: str, prefix: str) -> None:
    run(redis_url, prefix, _test_weights_from_the_fleet_setting)


async def _test_weights_from_the_fleet_setting(fleet: Fleet) -> None:
    await fleet.client.hset(fleet.keys.tenant_weights, mapping={"big": "3", "bad": "-1"})
    fair = fleet.fair("w1")
    assert await fair.refresh_weights() == {"big": 3.0}
    for i in range(8):
        await fleet.add(f"big{i}", "big", max_tokens=100)
        await fleet.add(f"small{i}", "small", max_tokens=100)
    order = request_ids(await fair.pick(8, now_ms=fleet.clock_ms))
    assert sum(r.startswith("big") for r in order) == 6  # three to one, while both wait


def test_a_settled_job_charges_its_tokens_not_its_estimate(redis_url: str, prefix: str) -> None:
    run(redis_url, prefix, _test_a_settled_job_charges_its_tokens_not_its_estimate)


async def _test_a_settled_job_charges_its_tokens_not_its_estimate(fleet: Fleet) -> None:
    fair = fleet.fair("w1")
    await fleet.add("a0", "a", max_tokens=1000)
    await fleet.add("b0", "b", max_tokens=100)
    picked = await fair.pick(2, now_ms=fleet.clock_ms)
    for delivery in picked.deliveries:
        fair.started(delivery, picked.charges[delivery.entry_id])
    assert fair.running_by_tenant() == {"a": 1, "b": 1}
    # a0 generated 10 tokens, not its 1000: a is charged 10, b 100, so a goes first.
    fair.closed("a0", 10)
    fair.closed("b0", 100)
    for delivery in picked.deliveries:
        fair.ended(delivery.entry_id)
    await fleet.add("b1", "b", max_tokens=10)
    await fleet.add("a1", "a", max_tokens=10)
    assert request_ids(await fair.pick(1, now_ms=fleet.clock_ms)) == ["a1"]
    served = await fleet.client.hgetall(fleet.keys.fair("m").served(_bucket_now()))
    assert served == {b"a": b"10", b"b": b"100"}


def test_default_tenant_and_undecodable_jobs_still_run(redis_url: str, prefix: str) -> None:
    run(redis_url, prefix, _test_default_tenant_and_undecodable_jobs_still_run)


async def _test_default_tenant_and_undecodable_jobs_still_run(fleet: Fleet) -> None:
    await fleet.add("plain")
    await fleet.add("bad-tenant", "no spaces allowed")
    await fleet.client.xadd(fleet.stream.stream, {"job": b"\xc1garbage"})
    picked = await fleet.fair("w1").pick(5, now_ms=fleet.clock_ms)
    assert len(picked.deliveries) == 3
    assert {c.tenant for c in picked.charges.values()} == {"default"}


def test_a_backlog_longer_than_one_intake_is_filed_while_slots_are_busy(
    redis_url: str, prefix: str
) -> None:
    run(redis_url, prefix, _test_a_backlog_longer_than_one_intake_is_filed_while_slots_are_busy)


async def _test_a_backlog_longer_than_one_intake_is_filed_while_slots_are_busy(
    fleet: Fleet,
) -> None:
    for i in range(INTAKE * 2 + 10):
        await fleet.add(f"a{i}", "team-a", max_tokens=10)
    await fleet.add("b0", "team-b", max_tokens=10)
    fair = fleet.fair("w1")
    assert request_ids(await fair.pick(1, now_ms=fleet.clock_ms)) == ["a0"]
    # One intake per pick would reach b0 only after two more picks; the worker files new
    # entries while its slots are busy (pick 0, a larger intake), so the next pick is b0.
    await fair.pick(0, now_ms=fleet.clock_ms, intake=INTAKE_WHILE_BUSY)
    assert request_ids(await fair.pick(1, now_ms=fleet.clock_ms)) == ["b0"]


def test_refused_jobs_are_not_free(redis_url: str, prefix: str) -> None:
    run(redis_url, prefix, _test_refused_jobs_are_not_free)


async def _test_refused_jobs_are_not_free(fleet: Fleet) -> None:
    """One slot; an attacker's 40 jobs that each end with no token computed (image bombs,
    refused), queued before a victim's 4 jobs of 12 tokens: the victim's jobs take turns with
    the refusals instead of waiting for all 40 (a refusal free of charge would put the
    victim's 2nd job 41st)."""
    fair = fleet.fair("w1")
    for i in range(40):
        await fleet.add(f"bomb{i}", "attacker", max_tokens=8)
    for i in range(4):
        await fleet.add(f"victim{i}", "victim", max_tokens=8)
    order: list[str] = []
    while len(order) < 44:
        picked = await fair.pick(1, now_ms=fleet.clock_ms)
        (delivery,) = picked.deliveries
        fair.started(delivery, picked.charges[delivery.entry_id])
        (request_id,) = request_ids(picked)
        order.append(request_id)
        if request_id.startswith("victim"):
            fair.closed(request_id, 12)  # a refused bomb computes nothing: no closed()
        fair.ended(delivery.entry_id)
    starts = [n for n, request_id in enumerate(order) if request_id.startswith("victim")]
    assert starts[-1] < 8, order  # every victim job within the first 8 starts
    assert order.index("bomb39") == 43  # all of them ran, the attacker's last
