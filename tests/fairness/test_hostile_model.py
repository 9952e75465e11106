"""Model-based: random producer and operator writes to fair share's keys between picks, on a
real redis-server. Whatever the writes (keys deleted, of another type, text or inf where a
number was, garbage members, entries taken by a pick that stopped half way), every job
queued runs exactly once, and nothing is left waiting once the workers sweep."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_redis_worker.daemon.fair_queue import FAIR_CONSUMER
from tests.fairness.test_hostile_state import drain, serve, waiting
from tests.fairness.test_pick import Fleet

TENANTS = ("t0", "t1", "t2")
GARBAGE = ("hello", "nan", "inf", "-inf", "1e300", "-1", "", "0x10")
FAIR_KEYS = ("backlogged", "idle", "state", "weights", "q:t0", "age:t0", "q:t1", "age:t2")

ops = st.one_of(
    st.tuples(st.just("add"), st.sampled_from((*TENANTS, "new")), st.integers(-2, 2)),
    st.tuples(st.just("pick"), st.integers(1, 3)),
    st.tuples(st.just("sweep")),
    st.tuples(st.just("delete"), st.sampled_from(FAIR_KEYS)),
    st.tuples(st.just("wrong_type"), st.sampled_from(FAIR_KEYS)),
    st.tuples(st.just("clock"), st.sampled_from(("vtime", "fresh")), st.sampled_from(GARBAGE)),
    st.tuples(st.just("weight"), st.sampled_from(TENANTS), st.sampled_from(GARBAGE)),
    st.tuples(
        st.just("tag"),
        st.sampled_from((*TENANTS, "ghost", "bad name!")),
        st.sampled_from((float("inf"), float("-inf"), 1e300, -5.0, 0.0)),
    ),
    st.tuples(st.just("member"), st.sampled_from(TENANTS), st.sampled_from(("junk", "steal"))),
    st.tuples(st.just("half_pick")),
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(script=st.lists(ops, min_size=5, max_size=40))
def test_every_job_runs_exactly_once_whatever_is_written(
    redis_url: str, script: list[tuple[Any, ...]]
) -> None:
    asyncio.run(play(redis_url, script))


async def play(redis_url: str, script: list[tuple[Any, ...]]) -> None:
    client = aioredis.Redis.from_url(redis_url)
    fleet = Fleet(client, f"h{uuid.uuid4().hex[:10]}")
    keys = fleet.keys.fair("m")
    fair = fleet.fair("w1")
    queued: list[str] = []
    served: list[str] = []
    try:
        await fleet.queue("w1").ensure_group()
        for op in script:
            kind = op[0]
            if kind == "add":
                tenant = f"n{len(queued)}" if op[1] == "new" else op[1]
                queued.append(f"r{len(queued)}")
                await fleet.add(queued[-1], tenant, priority=op[2], max_tokens=8)
            elif kind == "pick":
                served += await serve(fleet, fair, picks=op[1])
            elif kind == "sweep":
                await fair.sweep()
            elif kind == "delete":
                await client.delete(keys.queue_base + op[1])
            elif kind == "wrong_type":
                await client.delete(keys.queue_base + op[1])
                await client.set(keys.queue_base + op[1], "x")
            elif kind == "clock":
                await client.delete(keys.state)
                await client.hset(keys.state, op[1], op[2])
            elif kind == "weight":
                await client.delete(keys.weights)
                await client.hset(keys.weights, op[1], op[2])
            elif kind == "tag":
                await client.delete(keys.backlogged)
                await client.zadd(keys.backlogged, {op[1]: op[2]})
            elif kind == "member":
                member = "junk" if op[2] == "junk" else await some_waiting_entry(fleet)
                if member is not None:
                    await client.delete(keys.queue(op[1]))
                    await client.zadd(keys.queue(op[1]), {member: -100})
            elif kind == "half_pick":  # what a pick that failed after its XREADGROUP leaves
                await client.xreadgroup(
                    fleet.stream.group, FAIR_CONSUMER, {fleet.stream.stream: ">"}, count=2
                )
        served += await drain(fleet, fair)
        assert sorted(served) == sorted(queued)  # each once: nothing lost, nothing twice
        assert await waiting(fleet) == 0
    finally:
        await client.aclose()


async def some_waiting_entry(fleet: Fleet) -> str | None:
    rows: Any = await fleet.client.xpending_range(
        fleet.stream.stream, fleet.stream.group, "-", "+", 1, consumername=FAIR_CONSUMER
    )
    return rows[0]["message_id"].decode() if rows else None
