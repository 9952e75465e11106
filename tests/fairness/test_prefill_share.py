"""Fair share counts a job's prefill as service (issue 35): a tenant whose jobs are long
uncached prompts is charged the prompt tokens the engine computed, beside those generated,
so it gets its weight of the work, not its weight of the jobs. Two tenants of equal weight
on one slot of a real worker: the short prompts' tenant runs many jobs per long one."""

from __future__ import annotations

import pytest

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent
from tests.fairness.test_flood import FAIR, started_jobs
from tests.support.processes import WorkerFactory
from tests.support.waiting import run

JOBS = 12


def long_prompt(index: int) -> str:
    """About 2,400 bytes no prefix cache holds (every job's words are its own)."""
    return " ".join(f"w{index}x{word}" for word in range(300))


@pytest.mark.timeout(300)
def test_a_tenant_of_long_prompts_gets_its_share_of_the_work_not_of_the_jobs(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    async def queue() -> tuple[list[str], list[str]]:
        # Queued before the worker starts: both tenants wait from its first pick on.
        async with Client(redis_url, prefix=prefix) as client:
            long_ids, short_ids = [], []
            for i in range(JOBS):
                long_ids.append(await client.submit(long_prompt(i), max_tokens=4, tenant="long"))
                short_ids.append(await client.submit(f"hi {i}", max_tokens=4, tenant="short"))
            return long_ids, short_ids

    async def finish(rids: list[str]) -> None:
        async with Client(redis_url, prefix=prefix) as client:
            for rid in rids:
                assert isinstance(await client.wait(rid, timeout=240), DoneEvent)

    long_ids, short_ids = run(queue())
    worker = workers.start("w1", max_concurrency=1, env=FAIR)
    # The order is settled once every short job has run: the long jobs still queued then (the
    # most of them, each a long prefill) are not waited for; those started before the last
    # short one must end done too.
    run(finish(short_ids))
    order = [rid for rid, _ in started_jobs([worker])]
    last_short = max(order.index(rid) for rid in short_ids)
    started_long = [rid for rid in long_ids if rid in order[:last_short]]
    run(finish(started_long))
    long_before = len(started_long)
    print(f"long-prompt jobs started before the last short one: {long_before} of {JOBS}")
    # A long job's service is about 20 short ones' (its prompt is): equal jobs (the old
    # count, generated tokens only) would start 11 or 12 of them first.
    assert long_before <= 3
