"""Two teams sharing a fleet (issue 29): team A floods one model with long jobs, team B
queues one short job a second later. With fair share, B's job starts as soon as a slot
frees, not after the flood; with two workers, across a worker's restart mid-flood, and on a
Redis Cluster. Real workers (the tiny model, 2 slots each) on a real redis-server.

Fairness is read from the workers' own logs, as counts: how many flood jobs started
between B's job being queued and B's job starting. First in, first out starts every flood
job still queued before B's (the whole rest of the flood); fair share starts at most the
jobs of the slots that freed meanwhile. Counts, not seconds, so a loaded machine changes
nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

import pytest

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent
from mlx_redis_worker.local_redis import LocalCluster
from tests.daemon.helpers import check_stream, collect
from tests.support.processes import WorkerFactory, WorkerProcess
from tests.support.waiting import run

# Six rounds of the fleet's slots: when B's job is queued a round or so has started, and
# first in, first out would start the other four or five rounds' jobs (8 or more) before B's.
ROUNDS, SLOTS_PER_WORKER, FLOOD_TOKENS, LATE_TOKENS = 6, 2, 32, 8
FAIR = {"MLXW_FAIR_SHARE": "1"}


def flood(
    workers: WorkerFactory,
    redis_url: str,
    prefix: str,
    *,
    fleet: int = 1,
    outage: Callable[[], None] | None = None,
) -> int:
    """Flood jobs that started after B's job was queued and before it started, for a fleet
    of ``fleet`` workers. ``outage`` runs (in a thread) right after B's job is queued."""
    jobs = ROUNDS * SLOTS_PER_WORKER * fleet

    async def main() -> tuple[str, datetime]:
        async with Client(redis_url, prefix=prefix) as client:
            flood_ids = [
                await client.submit(
                    f"Team A's report number {i}:", max_tokens=FLOOD_TOKENS, tenant="team-a"
                )
                for i in range(jobs)
            ]
            flood_done = [asyncio.create_task(collect(client, rid, None)) for rid in flood_ids]
            await asyncio.sleep(1.0)
            queued = datetime.now(UTC)
            late = await client.submit("Hello", max_tokens=LATE_TOKENS, tenant="team-b")
            if outage is not None:
                await asyncio.to_thread(outage)
            late_events = await collect(client, late, None)
            for events, rid in zip(await asyncio.gather(*flood_done), flood_ids, strict=True):
                assert isinstance(check_stream(events, rid).terminal, DoneEvent)
            assert isinstance(check_stream(late_events, late).terminal, DoneEvent)
            return late, queued

    late, queued = run(main())
    starts = started_jobs(workers.started)
    late_start = min(at for rid, at in starts if rid == late)
    between = {rid for rid, at in starts if rid != late and queued < at < late_start}
    print(f"flood jobs started between B's queueing and its start: {len(between)} of {jobs}")
    return len(between)


def started_jobs(processes: Iterable[WorkerProcess]) -> list[tuple[str, datetime]]:
    """Every ``job_started`` line of the fleet's logs, as (request id, when). A restarted
    worker appends to its log: each log is read once."""
    logs = {process.log_path: process for process in processes}
    return [
        (event["request_id"], datetime.fromisoformat(event["timestamp"]))
        for process in logs.values()
        for event in process.log_events()
        if event.get("event") == "job_started"
    ]


def fair_worker(workers: WorkerFactory, worker_id: str) -> WorkerProcess:
    return workers.start(worker_id, max_concurrency=SLOTS_PER_WORKER, env=FAIR)


@pytest.mark.timeout(600)
def test_a_short_job_of_another_team_starts_at_the_next_free_slot(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    fair_worker(workers, "w1")
    assert flood(workers, redis_url, prefix) <= SLOTS_PER_WORKER


@pytest.mark.timeout(600)
def test_fair_share_holds_with_two_workers(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    fair_worker(workers, "w1")
    fair_worker(workers, "w2")
    assert flood(workers, redis_url, prefix, fleet=2) <= 2 * SLOTS_PER_WORKER


@pytest.mark.timeout(600)
def test_fair_share_holds_across_a_worker_restart_mid_flood(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    first = fair_worker(workers, "w1")

    def restart() -> None:
        # Killed outright: its two running jobs stay pending for it, the waiting ones stay in
        # Redis' fair queue; the restarted worker (same id) runs its own first (they start
        # again: two starts B may wait for), then picks.
        first.kill()
        fair_worker(workers, "w1")

    assert flood(workers, redis_url, prefix, outage=restart) <= 2 * SLOTS_PER_WORKER


@pytest.mark.timeout(600)
def test_fair_share_holds_on_a_redis_cluster(
    workers: WorkerFactory, redis_cluster: LocalCluster, prefix: str
) -> None:
    """Every fair-share key of a model is tagged with its name: the pick script runs on the
    node of the model's stream."""
    workers.start("w1", max_concurrency=SLOTS_PER_WORKER, env=FAIR, redis_url=redis_cluster.url)
    assert flood(workers, redis_cluster.url, prefix) <= SLOTS_PER_WORKER
