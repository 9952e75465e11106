"""Fair share's keys written by someone else (an operator's cleanup, a stray HSET, a producer
that invents tenants), on a real redis-server: no job is lost or run twice, the model's queue
keeps moving, shares are not skewed, and each repair is logged once with its key."""

from __future__ import annotations

from typing import Any

import structlog

from mlx_redis_worker.daemon.fair_queue import FAIR_CONSUMER, FairQueue
from mlx_redis_worker.daemon.fair_script import IDLE_TTL_SECONDS, NEWCOMER_ALLOWANCE
from tests.fairness.test_pick import Fleet, request_ids, run
from tests.fairness.test_pick import job as job_body


async def serve(fleet: Fleet, fair: FairQueue, *, picks: int, tokens: int = 8) -> list[str]:
    """Up to ``picks`` jobs picked one at a time, each run to its end (``tokens`` of service,
    settled with the next pick, acknowledged as a worker does); their request ids in order."""
    served: list[str] = []
    queue = fleet.queue(fair.consumer)
    for _ in range(picks):
        picked = await fair.pick(1, now_ms=fleet.clock_ms)
        if not picked.deliveries:
            break
        (delivery,) = picked.deliveries
        fair.started(delivery, picked.charges[delivery.entry_id])
        (rid,) = request_ids(picked)
        fair.closed(rid, tokens)
        fair.ended(delivery.entry_id)
        await queue.ack(delivery.entry_id)
        served.append(rid)
    return served


async def drain(fleet: Fleet, fair: FairQueue) -> list[str]:
    """Serve until nothing waits, sweeping as the reclaim interval would between rounds."""
    served: list[str] = []
    for _ in range(50):
        await fair.sweep()
        batch = await serve(fleet, fair, picks=1000)
        served += batch
        if not batch and not await waiting(fleet):
            break
    return served


async def waiting(fleet: Fleet) -> int:
    summary: Any = await fleet.client.xpending(fleet.stream.stream, fleet.stream.group)
    return sum(
        int(c["pending"]) for c in summary["consumers"] if c["name"].decode() == FAIR_CONSUMER
    )


def repairs(logs: list[dict[str, Any]]) -> list[str]:
    return [entry["key"] for entry in logs if entry["event"] == "fair_share_key_repaired"]


def test_a_stray_text_virtual_time_is_repaired_and_strands_no_job(
    redis_url: str, prefix: str
) -> None:
    async def scenario(fleet: Fleet) -> None:
        fair = fleet.fair("w1")
        for i in range(6):
            await fleet.add(f"r{i}", f"t{i % 3}")
        await fleet.client.hset(fleet.keys.fair("m").state, "vtime", "hello")
        with structlog.testing.capture_logs() as logs:
            served = await drain(fleet, fair)
        assert sorted(served) == [f"r{i}" for i in range(6)]
        assert repairs(logs) == [f"{fleet.keys.fair('m').state} vtime"]  # once, with its key

    run(redis_url, prefix, scenario)


def test_deleting_a_tenants_keys_loses_no_job(redis_url: str, prefix: str) -> None:
    """The operator's cleanup of every fair-share key of a tenant, and of the backlogged set,
    after the jobs were filed: the sweep files them again from the pending list."""

    async def scenario(fleet: Fleet) -> None:
        fair = fleet.fair("w1")
        keys = fleet.keys.fair("m")
        for i in range(9):
            await fleet.add(f"a{i}", "team-a" if i % 3 else "team-b")
        first = await serve(fleet, fair, picks=1)
        await fleet.client.delete(keys.queue("team-a"), keys.ages("team-a"), keys.backlogged)
        await fleet.client.delete(keys.state, keys.idle)
        served = await drain(fleet, fair)
        assert sorted(first + served) == sorted(f"a{i}" for i in range(9))
        assert await waiting(fleet) == 0

    run(redis_url, prefix, scenario)


def test_entries_taken_by_a_pick_that_stopped_half_way_are_found(
    redis_url: str, prefix: str
) -> None:
    """What a script that failed after its XREADGROUP leaves: entries pending for the fair
    consumer that no queue holds. A failed call makes the next one sweep."""

    async def scenario(fleet: Fleet) -> None:
        for i in range(6):
            await fleet.add(f"r{i}", "t1")
        await fleet.client.xreadgroup(
            fleet.stream.group, FAIR_CONSUMER, {fleet.stream.stream: ">"}, count=10
        )
        fair = fleet.fair("w1")
        served = await serve(fleet, fair, picks=10)
        assert served == []  # nothing new, nothing filed: only a sweep finds them
        await fair.sweep()
        assert await serve(fleet, fair, picks=10) == [f"r{i}" for i in range(6)]

    run(redis_url, prefix, scenario)


def test_keys_of_another_type_are_replaced_and_the_queue_moves(redis_url: str, prefix: str) -> None:
    async def scenario(fleet: Fleet) -> None:
        keys = fleet.keys.fair("m")
        fair = fleet.fair("w1")
        for i in range(6):
            await fleet.add(f"r{i}", f"t{i % 2}")
        broken = [keys.backlogged, keys.idle, keys.state, keys.weights, keys.queue("t0")]
        broken += [keys.ages("t1")]
        for key in broken:
            await fleet.client.set(key, "x")
        with structlog.testing.capture_logs() as logs:
            served = await drain(fleet, fair)
        assert sorted(served) == [f"r{i}" for i in range(6)]
        found = repairs(logs)
        assert sorted(set(found)) == sorted(broken)
        assert len(found) == len(set(found))  # each once

    run(redis_url, prefix, scenario)


def test_an_infinite_or_text_weight_in_the_copy_does_not_skew_shares(
    redis_url: str, prefix: str
) -> None:
    """Someone writes inf (or text, or nan) into the workers' copy of the weights: the pick
    ignores and drops it (logged once), and the next refresh rewrites the copy from the
    fleet's hash. Two tenants of equal weight share 100 picks evenly."""

    async def scenario(fleet: Fleet) -> None:
        keys = fleet.keys.fair("m")
        fair = fleet.fair("w1")
        await fleet.client.hset(fleet.keys.tenant_weights, mapping={"a": "1", "b": "1"})
        await fair.refresh_weights()
        for i in range(60):
            await fleet.add(f"a{i}", "a", max_tokens=8)
            await fleet.add(f"b{i}", "b", max_tokens=8)
        await fleet.client.hset(keys.weights, mapping={"a": "inf", "b": "nan", "c": "x"})
        with structlog.testing.capture_logs() as logs:
            served = await serve(fleet, fair, picks=100)
            await fair.refresh_weights()
        assert sum(r.startswith("a") for r in served) == 50
        assert sorted(repairs(logs)) == [keys.weights, f"{keys.weights} a", f"{keys.weights} b"]
        assert await fleet.client.hgetall(keys.weights) == {b"a": b"1.0", b"b": b"1.0"}

    run(redis_url, prefix, scenario)


def test_start_tags_out_of_range_are_reset(redis_url: str, prefix: str) -> None:
    """A tenant's start tag set to +inf would starve it while anyone else waits; -inf would
    give it every slot. Both are reset to virtual time."""

    async def scenario(fleet: Fleet) -> None:
        keys = fleet.keys.fair("m")
        fair = fleet.fair("w1")
        for i in range(20):
            await fleet.add(f"a{i}", "a", max_tokens=8)
            await fleet.add(f"b{i}", "b", max_tokens=8)
            await fleet.add(f"c{i}", "c", max_tokens=8)
        await serve(fleet, fair, picks=3)
        await fleet.client.zadd(keys.backlogged, {"a": float("inf"), "b": float("-inf")})
        served = await serve(fleet, fair, picks=30)
        counts = {t: sum(r.startswith(t) for r in served) for t in "abc"}
        # Within one job of an even share each (the tags were level when they were reset).
        assert all(9 <= count <= 11 for count in counts.values()), counts

    run(redis_url, prefix, scenario)


def test_tenants_invented_per_job_cannot_starve_an_honest_tenant(
    redis_url: str, prefix: str
) -> None:
    """A producer names a new tenant for every job (500 of them, queued first). Each new
    name would start at virtual time, before the honest tenant's next job, for ever: they
    share one newcomer's share instead, after an allowance. The honest tenant (known: it
    ran a job before) gets half the slots."""

    async def scenario(fleet: Fleet) -> None:
        fair = fleet.fair("w1")
        await fleet.add("h-first", "honest", max_tokens=16)
        assert await serve(fleet, fair, picks=1) == ["h-first"]
        for i in range(500):
            await fleet.add(f"x{i}", f"invented-{i}", max_tokens=16)
        for i in range(100):
            await fleet.add(f"h{i}", "honest", max_tokens=16)
        served = await serve(fleet, fair, picks=200, tokens=16)
        honest = sum(r.startswith("h") for r in served)
        # The allowance lets the first newcomers join level (NEWCOMER_ALLOWANCE / a job's
        # charge of about 30), then the two alternate.
        burst = NEWCOMER_ALLOWANCE // 16
        assert honest >= (200 - burst) // 2 - 2, served

    run(redis_url, prefix, scenario)


def test_the_idle_set_expires_and_forgets(redis_url: str, prefix: str) -> None:
    async def scenario(fleet: Fleet) -> None:
        keys = fleet.keys.fair("m")
        fair = fleet.fair("w1")
        for i in range(300):
            await fleet.add(f"r{i}", f"drained-{i}", max_tokens=8)
        assert len(await drain(fleet, fair)) == 300
        assert await fleet.client.zcard(keys.idle) > 0
        assert 0 < await fleet.client.ttl(keys.idle) <= IDLE_TTL_SECONDS

    run(redis_url, prefix, scenario)


def test_garbage_members_are_dropped(redis_url: str, prefix: str) -> None:
    """Members that name no tenant or no entry, an entry filed under the wrong tenant: none
    stops the queue, and the misfiled entry runs once, charged to its own tenant."""

    async def scenario(fleet: Fleet) -> None:
        keys = fleet.keys.fair("m")
        fair = fleet.fair("w1")
        entry = await fleet.add("b0", "b")
        await fleet.add("a0", "a")
        await fair.pick(0, now_ms=fleet.clock_ms)
        await fleet.client.zadd(keys.backlogged, {"no such tenant!": -1, "a": 0})
        await fleet.client.zadd(keys.queue("a"), {"garbage": -100, entry: -50})
        picked = await fair.pick(3, now_ms=fleet.clock_ms)
        assert sorted(request_ids(picked)) == ["a0", "b0"]
        assert {c.tenant for c in picked.charges.values()} == {"a", "b"}
        assert picked.charges[entry].tenant == "b"

    run(redis_url, prefix, scenario)


def test_tenant_weight_ignored_is_logged_once_per_change(redis_url: str, prefix: str) -> None:
    async def scenario(fleet: Fleet) -> None:
        fair = fleet.fair("w1")
        await fleet.client.hset(fleet.keys.tenant_weights, mapping={"a": "2", "bad": "inf"})
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):
                await fair.refresh_weights()
            await fleet.client.hset(fleet.keys.tenant_weights, "bad", "-1")
            for _ in range(3):
                await fair.refresh_weights()
        ignored = [e["weight"] for e in logs if e["event"] == "tenant_weight_ignored"]
        assert ignored == ["inf", "-1"]
        # The fleet's hash of another type: logged once, no weights, the queue keeps going.
        await fleet.client.delete(fleet.keys.tenant_weights)
        await fleet.client.set(fleet.keys.tenant_weights, "x")
        with structlog.testing.capture_logs() as logs:
            assert await fair.refresh_weights() == {}
            assert await fair.refresh_weights() == {}
        assert [e["event"] for e in logs].count("tenant_weights_unreadable") == 1

    run(redis_url, prefix, scenario)


def test_shares_read_keys_of_another_type_as_empty(redis_url: str, prefix: str) -> None:
    """`models`, `stats` and the metrics read the same keys: a stray SET on them (before the
    next pick repairs it) shows nothing there instead of failing the whole view."""

    async def scenario(fleet: Fleet) -> None:
        keys = fleet.keys.fair("m")
        fair = fleet.fair("w1")
        await fleet.add("r0", "t0")
        await fleet.add("r1", "t1")
        await fair.pick(0, now_ms=fleet.clock_ms)
        await fleet.client.delete(keys.queue("t0"))
        await fleet.client.set(keys.queue("t0"), "x")
        shares = {s["tenant"]: s["queued"] for s in await fair.shares()}
        assert shares == {"t0": 0, "t1": 1}
        await fleet.client.delete(keys.backlogged)
        await fleet.client.set(keys.backlogged, "x")
        assert await fair.shares() == []

    run(redis_url, prefix, scenario)


def test_one_sweep_files_a_long_lost_list_again(redis_url: str, prefix: str) -> None:
    """Every fair-share key deleted under 700 waiting jobs: one sweep (more calls while they
    find lost entries) files them all again, and every job runs once."""

    async def scenario(fleet: Fleet) -> None:
        keys = fleet.keys.fair("m")
        fair = fleet.fair("w1")
        async with fleet.client.pipeline(transaction=False) as pipe:
            for i in range(700):
                fleet.clock_ms += 1
                body = job_body(f"r{i}", f"t{i % 5}")
                pipe.xadd(fleet.stream.stream, {"job": body}, id=f"{fleet.clock_ms}-0")
            await pipe.execute()
        await fair.pick(0, now_ms=fleet.clock_ms, intake=1024)
        doomed = [keys.backlogged, keys.idle, keys.state]
        doomed += [keys.queue(f"t{i}") for i in range(5)] + [keys.ages(f"t{i}") for i in range(5)]
        await fleet.client.delete(*doomed)
        await fair.sweep()
        served = await serve(fleet, fair, picks=800)
        assert sorted(served) == sorted(f"r{i}" for i in range(700))

    run(redis_url, prefix, scenario)


def test_a_newcomers_clock_far_ahead_is_reset(redis_url: str, prefix: str) -> None:
    """`fresh` written far ahead (a finite number, yet no backlog of newcomers explains it)
    would make every new tenant wait behind the known ones for good: the start tag it gives
    a newcomer is out of range, and reset to virtual time."""

    async def scenario(fleet: Fleet) -> None:
        keys = fleet.keys.fair("m")
        fair = fleet.fair("w1")
        await fleet.add("k0", "known", max_tokens=8)
        assert await serve(fleet, fair, picks=1) == ["k0"]
        await fleet.client.hset(keys.state, "fresh", "1e14")
        for i in range(10):
            await fleet.add(f"k{i + 1}", "known", max_tokens=8)
        await fleet.add("n0", "new", max_tokens=8)
        assert "n0" in await serve(fleet, fair, picks=3)

    run(redis_url, prefix, scenario)
