"""The fair pick script alone, on a real redis-server, against simulated tenants (random
arrivals, lengths, priorities and weights) served by one slot on a simulated clock:

* while two tenants both have work, the tokens each is served, divided by its weight, differ
  by at most one largest job each (start-time fair queuing's bound);
* a job past the age bound goes before every younger job of its tenant: no priority starves.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from dataclasses import dataclass

import msgpack
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_redis_protocol.keys import Keys
from mlx_redis_worker.daemon.fair_queue import FairQueue
from mlx_redis_worker.daemon.job_queue import JobQueue

TENANTS = ("t0", "t1", "t2")
AGE_BOUND_MS = 400
START_MS = 1_000_000


@dataclass
class SimJob:
    index: int
    tenant: str
    arrival: int  # ms
    max_tokens: int
    tokens: int  # generated: at most max_tokens (1 token per ms of the slot)
    priority: int
    picked: int | None = None
    ended: int | None = None


jobs_strategy = st.lists(
    st.tuples(
        st.sampled_from(TENANTS),
        st.integers(min_value=0, max_value=1500),  # arrival after the start
        st.integers(min_value=1, max_value=60),  # max_tokens
        st.floats(min_value=0.1, max_value=1.0),  # share of max_tokens generated
        st.sampled_from((-1, 0, 1)),
    ),
    min_size=2,
    max_size=40,
)
weights_strategy = st.fixed_dictionaries({t: st.sampled_from((1, 2, 3)) for t in TENANTS})


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(raw=jobs_strategy, weights=weights_strategy)
def test_service_stays_within_one_job_of_the_weighted_share(
    redis_url: str, raw: list[tuple[str, int, int, float, int]], weights: dict[str, int]
) -> None:
    jobs = [
        SimJob(i, tenant, START_MS + at, top, max(1, int(top * share)), priority)
        for i, (tenant, at, top, share, priority) in enumerate(sorted(raw, key=lambda r: r[1]))
    ]
    asyncio.run(simulate(redis_url, jobs, weights))
    assert all(job.ended is not None for job in jobs)
    check_fair_share(jobs, weights, largest=max(job.max_tokens for job in jobs))
    check_age_bound(jobs)


async def simulate(redis_url: str, jobs: list[SimJob], weights: dict[str, int]) -> None:
    """One slot; a pick whenever it is free, at the simulated time (settling the job that
    just ended in the same call, as a worker does)."""
    client = aioredis.Redis.from_url(redis_url)
    keys = Keys(f"p{uuid.uuid4().hex[:10]}")
    stream = keys.model_stream("m")
    try:
        await JobQueue(redis=client, stream=stream, consumer="w", lease_ms=1000).ensure_group()
        await client.hset(keys.tenant_weights, mapping={t: str(w) for t, w in weights.items()})
        fair = FairQueue(
            redis=client,
            stream=stream,
            keys=keys.fair("m"),
            consumer="w",
            tenant_weights_key=keys.tenant_weights,
            age_bound_seconds=AGE_BOUND_MS / 1000,
        )
        await fair.refresh_weights()
        by_entry: dict[str, SimJob] = {}
        arrivals = iter(jobs)
        upcoming = next(arrivals, None)
        now = START_MS
        while any(job.ended is None for job in jobs):
            while upcoming is not None and upcoming.arrival <= now:
                body = {
                    "v": 1,
                    "request_id": f"r{upcoming.index}",
                    "prompt": "x",
                    "tenant": upcoming.tenant,
                    "max_tokens": upcoming.max_tokens,
                    "priority": upcoming.priority,
                }
                entry: bytes = await client.xadd(
                    stream.stream, {"job": msgpack.packb(body)}, id=f"{upcoming.arrival}-*"
                )
                by_entry[entry.decode()] = upcoming
                upcoming = next(arrivals, None)
            picked = await fair.pick(1, now_ms=now)
            if not picked.deliveries:
                assert upcoming is not None, "jobs left unpicked with nothing waiting"
                now = upcoming.arrival
                continue
            (delivery,) = picked.deliveries
            job = by_entry[delivery.entry_id]
            fair.started(delivery, picked.charges[delivery.entry_id])
            job.picked = now
            now += job.tokens
            job.ended = now
            fair.closed(f"r{job.index}", job.tokens)
            fair.ended(delivery.entry_id)
    finally:
        await client.aclose()


def served(job: SimJob, start: int, end: int) -> int:
    """Tokens of ``job`` generated within [start, end) (one per ms while it runs)."""
    assert job.picked is not None and job.ended is not None
    return max(0, min(end, job.ended) - max(start, job.picked))


def backlogged(jobs: list[SimJob], tenant: str, start: int, end: int) -> bool:
    """The tenant had a job arrived and not ended at every moment of [start, end)."""
    spans = sorted(
        (job.arrival, job.ended) for job in jobs if job.tenant == tenant and job.ended is not None
    )
    covered = start
    for arrival, ended in spans:
        if arrival > covered:
            break
        covered = max(covered, ended)
    return covered >= end


def check_fair_share(jobs: list[SimJob], weights: dict[str, int], largest: int) -> None:
    moments = sorted({job.picked for job in jobs if job.picked is not None})
    moments.append(max(job.ended or 0 for job in jobs))
    for start, end in itertools.combinations(moments, 2):
        busy = [t for t in TENANTS if backlogged(jobs, t, start, end)]
        for a, b in itertools.combinations(busy, 2):
            share_a = sum(served(j, start, end) for j in jobs if j.tenant == a) / weights[a]
            share_b = sum(served(j, start, end) for j in jobs if j.tenant == b) / weights[b]
            bound = largest / weights[a] + largest / weights[b]
            assert abs(share_a - share_b) <= bound + 1e-9, (a, b, start, end, share_a, share_b)


def check_age_bound(jobs: list[SimJob]) -> None:
    """When a tenant's job is picked, none of its jobs that arrived earlier and still waits
    has waited past the age bound: those go first, oldest first, whatever the priorities."""
    for job in jobs:
        assert job.picked is not None
        for other in jobs:
            if other.tenant != job.tenant or other is job or other.arrival >= job.arrival:
                continue
            assert other.picked is not None
            overdue = other.picked > job.picked and job.picked - other.arrival >= AGE_BOUND_MS
            assert not overdue, (job, other)


def test_the_age_bound_lets_a_low_priority_job_run_amid_urgent_ones(redis_url: str) -> None:
    """A steady stream of urgent jobs would keep a batch job of the same tenant waiting for
    ever; past the age bound it goes first."""
    batch = SimJob(0, "t0", START_MS + 1, 10, 10, 1)
    urgent = [SimJob(i, "t0", START_MS + 9 * (i - 1), 10, 10, -1) for i in range(1, 120)]
    jobs = sorted([batch, *urgent], key=lambda job: job.arrival)
    asyncio.run(simulate(redis_url, jobs, {t: 1 for t in TENANTS}))
    check_age_bound(jobs)
    assert batch.picked is not None
    assert AGE_BOUND_MS <= batch.picked - batch.arrival <= AGE_BOUND_MS + 10
    assert batch.picked < max(job.picked or 0 for job in urgent)
