"""Workers dying, stopping and losing Redis: every request still ends exactly once."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.codec_events import decode_event
from mlx_redis_protocol.errors import StreamRewritten
from mlx_redis_protocol.messages import DoneEvent, Event
from mlx_redis_protocol.replay_log import read_log
from mlx_redis_worker.local_redis import RedisServer
from tests.daemon.helpers import (
    check_stream,
    collect,
    collect_surviving_restarts,
    health,
    log_length,
    pending_ids,
    settled,
)
from tests.support.processes import MODEL, WorkerFactory
from tests.support.prompts import random_prompts
from tests.support.references import GreedyReference
from tests.support.waiting import run, until, wait_until

T = TypeVar("T")

LONG = 300  # tokens: several seconds on 2 cores, so the job is mid-way when we strike
# Tokens of a job that is struck the moment it has its first deltas (SIGKILL, SIGSTOP, a
# Redis stop, a log cut): it only has to be running then, and each token is generated twice
# (the worker's attempts) and once more for the reference.
STRUCK = 100
# The log's ARGV[1] newest entries, deleted in one step (a failover to a replica that lagged).
DROP_NEWEST = """
local newest = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', ARGV[1])
for _, entry in ipairs(newest) do
  redis.call('XDEL', KEYS[1], entry[1])
end
return newest
"""


@pytest.fixture(scope="module", autouse=True)
def _greedy_texts_in_batches(reference: GreedyReference) -> None:
    """The greedy texts the tests below compare with, generated up front in one batch per
    length: a step of tiny on the CPU costs about as much for 7 rows as for one (mlx's
    evaluation, not the engine's Python), so 7 prompts of 200 tokens took 8.2 s against 6.6 s
    for one, and each test then finds its texts known. The same prompts and lengths as the
    tests' own (their seeds)."""
    seeds = [(3, 11), (3, 41), (1, 81), (1, 23)]  # SIGKILL, Redis restart, stalled, log cut
    texts = [text for count, seed in seeds for text in random_prompts(count, seed)]
    reference.texts(texts, STRUCK)
    reference.texts(random_prompts(1, seed=31), LONG)  # a short drain


async def _deltas_at_least(client: Client, request_ids: list[str], count: int) -> bool:
    """Every request has ``count`` events after its queued marker in the log."""
    lengths = [await log_length(client, rid) for rid in request_ids]
    return all(length > count for length in lengths)


async def _log_terminal(client: Client, request_id: str) -> bool:
    """Whether the request's log already holds a done or error event."""
    events = await _log_events(client, request_id)
    return any(event.terminal for event in events)


async def _log_events(client: Client, request_id: str) -> list[Event]:
    return [
        decode_event(entry.data) for entry in await read_log(client.redis, client.keys, request_id)
    ]


@pytest.mark.timeout(150)
def test_sigkill_mid_generation_another_worker_finishes_with_reset(
    workers: WorkerFactory, redis_url: str, prefix: str, reference: GreedyReference
) -> None:
    """A worker SIGKILLed mid-generation leaves its jobs pending; a second worker (short lease)
    reclaims them: each stream gets reset(attempt 2) then exactly one done with the greedy text.
    Also `mlx-worker health`: 0 while the worker runs, 1 once its heartbeat expired, 1 for an
    unknown worker id."""
    texts = random_prompts(3, seed=11)
    max_tokens = STRUCK
    expected = reference.texts(texts, max_tokens)
    victim = workers.start("victim", lease_seconds=2)
    assert health("victim", redis_url, prefix) == 0
    assert health("nobody", redis_url, prefix) == 1

    async def main() -> tuple[list[str], list[list[Event]], dict[str, int], dict[str, str]]:
        async with Client(redis_url, prefix=prefix) as client:
            rids = [
                await client.submit(text, max_tokens=max_tokens, temperature=0.0) for text in texts
            ]
            streams = [asyncio.create_task(collect(client, rid)) for rid in rids]
            await until(lambda: _deltas_at_least(client, rids, 5), 60, "deltas of every job")
            victim.kill()
            for rid in rids:  # really mid-generation
                assert not await _log_terminal(client, rid), rid
            at_kill = {rid: await log_length(client, rid) for rid in rids}
            owners = await pending_ids(client)
            assert sorted(owners.values()) == ["victim"] * 3

            # The heartbeat expires (TTL 2 s) and health says so.
            await asyncio.to_thread(
                wait_until, lambda: not victim.heartbeat_alive(), 10, "heartbeat expiry"
            )
            assert await asyncio.to_thread(health, "victim", redis_url, prefix) == 1

            await asyncio.to_thread(workers.start, "rescuer", lease_seconds=2)
            results = await asyncio.gather(*streams)
            await until(lambda: settled(client), 10, "entries acknowledged")
            return rids, results, at_kill, await pending_ids(client)

    rids, results, at_kill, pending = run(main())
    for rid, events, want in zip(rids, results, expected, strict=True):
        summary = check_stream(events, rid)
        assert isinstance(summary.terminal, DoneEvent), summary.terminal
        assert summary.attempts == [1, 2]
        assert [(r.attempt, r.seq) for r in summary.resets] == [(2, at_kill[rid])], (
            "the reset follows the last event the dead worker wrote"
        )
        assert summary.terminal.attempt == 2
        assert summary.terminal.finish_reason == "length"
        assert summary.terminal.usage.completion_tokens == max_tokens
        assert summary.terminal.output_text == want
        first_attempt = "".join(d.new_text for d in summary.deltas if d.attempt == 1)
        assert len([d for d in summary.deltas if d.attempt == 1]) >= 5
        assert want.startswith(first_attempt)  # greedy: the dead attempt was the same text
    assert pending == {}


@pytest.mark.timeout(120)
def test_worker_restarted_under_the_same_id_resumes_its_own_pending_jobs(
    workers: WorkerFactory, redis_url: str, prefix: str, reference: GreedyReference
) -> None:
    """SIGKILL, then the same worker id again (a supervisor restarting it): it reads its own
    pending entries at start, without waiting for a lease (60 s here) to expire."""
    text = random_prompts(1, seed=91)[0]
    max_tokens = 100
    expected = reference.texts([text], max_tokens)[0]
    first = workers.start("same", lease_seconds=60)

    async def main() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            rid = await client.submit(text, max_tokens=max_tokens, temperature=0.0)
            stream = asyncio.create_task(collect(client, rid))
            await until(lambda: _deltas_at_least(client, [rid], 5), 30, "first deltas")
            first.kill()
            at_kill = await log_length(client, rid)
            await asyncio.to_thread(workers.start, "same", lease_seconds=60)
            summary = check_stream(await asyncio.wait_for(stream, 30), rid)
            assert isinstance(summary.terminal, DoneEvent)
            assert [(r.attempt, r.seq) for r in summary.resets] == [(2, at_kill)]
            assert summary.terminal.output_text == expected
            await until(lambda: settled(client), 10, "entry acknowledged")

    run(main())


@pytest.mark.timeout(120)
def test_sigterm_drains_the_job_in_flight_and_exits_zero(
    workers: WorkerFactory, redis_url: str, prefix: str, reference: GreedyReference
) -> None:
    """SIGTERM: no new job is read, the running one finishes (done, acknowledged), exit 0."""
    text = random_prompts(1, seed=21)[0]
    max_tokens = 120
    expected = reference.texts([text], max_tokens)[0]
    worker = workers.start("drainer", drain_timeout=30)

    async def main() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            rid = await client.submit(text, max_tokens=max_tokens, temperature=0.0)
            stream = asyncio.create_task(collect(client, rid))
            await until(lambda: _deltas_at_least(client, [rid], 3), 30, "first deltas")
            signalled = time.monotonic()
            worker.signal(signal.SIGTERM)
            await asyncio.to_thread(
                wait_until,
                lambda: any(e.get("event") == "worker_stopping" for e in worker.log_events()),
                10,
                "worker_stopping in the log",
            )
            await asyncio.sleep(0.5)  # past any blocked read of the consumer
            late = await client.submit(text, max_tokens=5, temperature=0.0)

            code = await asyncio.to_thread(worker.wait, 30)
            took = time.monotonic() - signalled
            assert code == 0
            assert took < 30

            summary = check_stream(await stream, rid)
            assert isinstance(summary.terminal, DoneEvent)
            assert summary.terminal.finish_reason == "length"
            assert summary.terminal.usage.completion_tokens == max_tokens
            assert summary.terminal.output_text == expected
            # Acknowledged; the job submitted during the drain was never read.
            assert await pending_ids(client) == {}
            assert await log_length(client, late) == 1
            assert await client.redis.xlen(client.keys.jobs) == 1
            # A clean stop removes the heartbeat at once.
            assert not worker.heartbeat_alive()

    run(main())
    events = [e.get("event") for e in worker.log_events()]
    assert "drain_timeout_abandoning" not in events
    assert events[-1] == "worker_stopped"


@pytest.mark.timeout(150)
def test_sigterm_with_short_drain_leaves_the_job_to_another_worker(
    workers: WorkerFactory, redis_url: str, prefix: str, reference: GreedyReference
) -> None:
    """drain_timeout 1 s and a long job: exit 0 without acknowledging (still pending, no
    terminal event), and a second worker later completes it with reset + done."""
    text = random_prompts(1, seed=31)[0]
    expected = reference.texts([text], LONG)[0]
    worker = workers.start("quitter", drain_timeout=1, lease_seconds=2)

    async def main() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            rid = await client.submit(text, max_tokens=LONG, temperature=0.0)
            stream = asyncio.create_task(collect(client, rid))
            await until(lambda: _deltas_at_least(client, [rid], 3), 30, "first deltas")
            signalled = time.monotonic()
            worker.signal(signal.SIGTERM)
            code = await asyncio.to_thread(worker.wait, 30)
            assert code == 0
            assert time.monotonic() - signalled < 15
            assert not await _log_terminal(client, rid)
            owners = await pending_ids(client)
            assert list(owners.values()) == ["quitter"]
            at_stop = await log_length(client, rid)

            await asyncio.to_thread(workers.start, "successor", lease_seconds=2)
            summary = check_stream(await stream, rid)
            assert isinstance(summary.terminal, DoneEvent)
            assert [(r.attempt, r.seq) for r in summary.resets] == [(2, at_stop)]
            assert summary.terminal.attempt == 2
            assert summary.terminal.output_text == expected
            await until(lambda: settled(client), 10, "entry acknowledged")

    run(main())
    events = [e.get("event") for e in worker.log_events()]
    assert "drain_timeout_abandoning" in events
    assert "job_abandoned" in events


@pytest.mark.timeout(150)
def test_redis_restart_under_a_running_worker(
    workers: WorkerFactory, tmp_path: Path, reference: GreedyReference
) -> None:
    """Redis (appendonly) restarted while jobs stream: they complete, nothing is lost or
    doubled, and the worker serves new jobs afterwards."""
    server = RedisServer(extra_args=["--appendonly", "yes"], directory=tmp_path / "redis")
    server.start()
    try:
        _restart_scenario(workers, server, reference)
    finally:
        server.close()


def _restart_scenario(
    workers: WorkerFactory, server: RedisServer, reference: GreedyReference
) -> None:
    prefix = "restart"
    long_max, short_max = STRUCK, 12
    long_texts = random_prompts(3, seed=41)
    short_texts = random_prompts(3, seed=42)
    expected = {
        **dict(zip(long_texts, reference.texts(long_texts, long_max), strict=True)),
        **dict(zip(short_texts, reference.texts(short_texts, short_max), strict=True)),
    }
    worker = workers.start("survivor", redis_url=server.url, prefix=prefix)

    async def main() -> tuple[dict[str, tuple[str, list[Event]]], int, dict[str, object]]:
        async with Client(server.url, prefix=prefix) as client:
            long_ids = {
                await client.submit(t, max_tokens=long_max, temperature=0.0): t for t in long_texts
            }
            streams = {
                rid: asyncio.create_task(collect_surviving_restarts(client, rid))
                for rid in long_ids
            }
            await until(lambda: _deltas_at_least(client, list(long_ids), 5), 30, "deltas")
            await asyncio.to_thread(server.stop)
            await asyncio.sleep(1.0)  # the worker keeps generating and buffers meanwhile
            await asyncio.to_thread(server.start)

            short_ids = {}
            for text in short_texts:
                rid = await _retrying(
                    lambda t=text: client.submit(t, max_tokens=short_max, temperature=0.0)
                )
                short_ids[rid] = text
                streams[rid] = asyncio.create_task(collect_surviving_restarts(client, rid))
            results = {rid: await task for rid, task in streams.items()}
            await until(lambda: settled(client), 20, "every entry acknowledged")
            stats = await client.stats()
            texts = {**long_ids, **short_ids}
            failures = sum(failed for _, failed in results.values())
            return (
                {rid: (texts[rid], events) for rid, (events, _) in results.items()},
                failures,
                dict(stats[0].result["publisher"]),
            )

    results, client_failures, publisher = run(main())
    assert len(results) == 6
    for rid, (text, events) in results.items():
        summary = check_stream(events, rid)
        assert isinstance(summary.terminal, DoneEvent), summary.terminal
        assert summary.attempts == [1]  # nothing was re-run: the worker rode it out
        assert summary.terminal.output_text == expected[text]
    assert publisher["redis_failures"] >= 1, publisher  # it really lost Redis mid-stream
    assert publisher["pending_events"] == 0
    assert worker.running()
    print(f"client streams restarted {client_failures} times; publisher {publisher}")


@pytest.mark.timeout(120)
def test_worker_stalled_past_its_lease_is_fenced_off(
    workers: WorkerFactory, redis_url: str, prefix: str, reference: GreedyReference
) -> None:
    """SIGSTOP (a long GC pause, a frozen VM) past the lease: another worker reclaims the job;
    after SIGCONT the stale worker neither finishes it nor writes into its log (no seq twice,
    one terminal event), and does not acknowledge it."""
    text = random_prompts(1, seed=81)[0]
    max_tokens = STRUCK
    expected = reference.texts([text], max_tokens)[0]
    stalled = workers.start("stalled", lease_seconds=2)

    async def main() -> dict[str, dict[str, int]]:
        async with Client(redis_url, prefix=prefix) as client:
            rid = await client.submit(text, max_tokens=max_tokens, temperature=0.0)
            stream = asyncio.create_task(collect(client, rid))
            await until(lambda: _deltas_at_least(client, [rid], 5), 30, "first deltas")
            # Stopped before the second worker starts: a start takes seconds on a loaded
            # machine, time in which the stalled worker could finish all its tokens.
            stalled.signal(signal.SIGSTOP)
            try:
                await asyncio.to_thread(workers.start, "healthy", lease_seconds=2)
                await until(lambda: _owned_by(client, "healthy"), 30, "the job reclaimed")
                await asyncio.sleep(1.0)
            finally:
                stalled.signal(signal.SIGCONT)
            summary = check_stream(await stream, rid)
            assert isinstance(summary.terminal, DoneEvent)
            assert summary.terminal.attempt == 2
            assert summary.terminal.output_text == expected
            outcomes = await until(lambda: _idle_outcomes(client), 60, "both workers idle")

            entries = await read_log(client.redis, client.keys, rid)
            seqs = [entry.seq for entry in entries]
            assert seqs == list(range(len(seqs))), "the log holds a seq twice or out of order"
            terminals = [e for e in (decode_event(x.data) for x in entries) if e.terminal]
            assert len(terminals) == 1, terminals
            assert await settled(client)
            return outcomes

    outcomes = run(main())
    assert outcomes == {"stalled": {"lost_lease": 1}, "healthy": {"completed": 1}}


@pytest.mark.timeout(90)
def test_worker_recovers_when_redis_comes_back_empty(
    workers: WorkerFactory, tmp_path: Path
) -> None:
    """Redis restarted without persistence (or failed over to an empty replica) loses the
    consumer group: the worker re-creates it and serves the next job."""
    server = RedisServer(directory=tmp_path / "redis")  # no persistence: restart loses data
    server.start()
    try:
        worker = workers.start("amnesiac", redis_url=server.url, prefix="empty")

        async def main() -> None:
            async with Client(server.url, prefix="empty") as client:
                before = await client.generate("before", max_tokens=5, timeout=30)
                assert isinstance(before, DoneEvent)
            await asyncio.to_thread(server.restart)
            async with Client(server.url, prefix="empty") as client:
                assert not await client.redis.exists(client.keys.log(before.request_id))
                await asyncio.to_thread(
                    wait_until, worker.heartbeat_alive, 10, "heartbeat after the restart"
                )
                rid = await client.submit("after", max_tokens=5)
                done = await asyncio.wait_for(client.wait(rid), 30)
                assert isinstance(done, DoneEvent)
                assert done.usage.completion_tokens == 5

        run(main())
    finally:
        server.close()


async def _owned_by(client: Client, consumer: str) -> bool:
    return list((await pending_ids(client)).values()) == [consumer]


async def _idle_outcomes(client: Client) -> dict[str, dict[str, int]] | None:
    """Each worker's job outcomes once none has a job in flight (else None)."""
    replies = await client.stats(timeout=2)
    if len(replies) != 2 or any(r.result["jobs"]["in_flight"] for r in replies):
        return None
    return {r.worker_id: dict(r.result["jobs"]["outcomes"]) for r in replies}


async def _retrying(call: Callable[[], Awaitable[T]]) -> T:
    """A producer call retried while the connection pool reconnects after the restart."""
    for _ in range(50):
        try:
            return await call()
        except (RedisConnectionError, ConnectionError, OSError):
            await asyncio.sleep(0.1)
    return await call()


@pytest.mark.timeout(150)
def test_a_log_that_lost_its_newest_events_gets_a_new_attempt_not_a_hole(
    workers: WorkerFactory, redis_url: str, prefix: str, reference: GreedyReference
) -> None:
    """What a Sentinel failover to a lagging replica does to a running request: its log loses
    the newest entries the worker already wrote. The worker must not append after the hole
    (subscribers would wait forever for the missing seq): it gives the attempt up without an
    ack, the job is reclaimed once its lease runs out, and the new attempt continues the log
    from what is left, after a reset, to exactly one done with the greedy text. A subscriber
    that heard the lost events live learns that its history was rewritten."""
    text = random_prompts(1, seed=23)[0]
    expected = reference.texts([text], STRUCK)[0]
    worker = workers.start("gap-1", lease_seconds=2)

    async def main() -> tuple[list[Event], list[Event], int, dict[str, int], object, object]:
        async with Client(redis_url, prefix=prefix) as client:
            rid = await client.submit(text, max_tokens=STRUCK, temperature=0.0)
            live = asyncio.create_task(collect(client, rid))
            waited = asyncio.create_task(client.wait(rid, timeout=60))
            await until(lambda: _deltas_at_least(client, [rid], 6), 60, "the first deltas")
            # Read and delete at once: between a read and a delete the worker could append
            # its terminal event, which the delete then left behind after the hole (it did
            # once, on a loaded machine: the final read waited for the missing seq).
            newest = await client.redis.eval(DROP_NEWEST, 1, client.keys.log(rid), 2)
            lost_at = min(int(dict(zip(f[::2], f[1::2], strict=True))[b"seq"]) for _, f in newest)
            await until(lambda: _log_terminal(client, rid), 90, "the job's end")
            await until(lambda: settled(client), 30, "the ack")
            replies = await client.stats(timeout=5)
            outcomes = (replies[0].result or {}).get("jobs", {}).get("outcomes", {})
            live_ending = (await asyncio.gather(live, return_exceptions=True))[0]
            return (
                await collect(client, rid),
                await _log_events(client, rid),
                lost_at,
                outcomes,
                live_ending,
                await waited,
            )

    streamed, logged, lost_at, outcomes, live_ending, waited = run(main())
    # A subscriber that had heard the lost events is told its history was rewritten (instead
    # of merging two attempts' text); `wait` follows again and ends where the log ends.
    assert isinstance(live_ending, StreamRewritten), live_ending
    assert waited == logged[-1]
    summary = check_stream(logged, logged[0].request_id)
    assert summary.terminal.output_text == expected
    assert [reset.seq for reset in summary.resets] == [lost_at]  # the new attempt fills the hole
    assert summary.attempts == [1, 2]
    assert outcomes.get("log_gap") == 1
    assert streamed == logged
    assert worker.running()


@pytest.mark.timeout(150)
def test_an_orphaned_job_runs_before_the_queue_behind_it(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    """A job read by a worker that died must not wait until the stream runs dry: once its
    lease is over it runs as soon as a slot frees, ahead of the newer jobs queued behind it,
    although the one worker left is busy the whole time (its lease runs out only after the
    worker has filled its slots).

    Jobs run from the model's stream, so that is where the dead worker held it: queued there
    before any worker serves the model (``require_worker=False``); the jobs behind it are
    queued on the default stream, and forwarded behind it when the worker starts."""
    behind, max_tokens = 40, 32

    async def main() -> tuple[list[str], str]:
        async with Client(redis_url, prefix=prefix, require_worker=False) as client:
            jobs = client.keys.model_stream(MODEL)
            await client.redis.xgroup_create(jobs.stream, jobs.group, id="0", mkstream=True)
            orphan = await client.submit(
                "orphan", model=MODEL, max_tokens=max_tokens, temperature=0.0
            )
            # A consumer that took the job and died: the entry stays pending under its name.
            await client.redis.xreadgroup(jobs.group, "ghost", {jobs.stream: ">"}, count=1)
            assert list((await pending_ids(client)).values()) == ["ghost"]
            rids = [
                await client.submit(text, max_tokens=max_tokens, temperature=0.0)
                for text in random_prompts(behind, seed=41)
            ]
            workers.start("busy-1", max_concurrency=2, lease_seconds=3)
            finished: list[str] = []

            async def follow(rid: str) -> None:
                await collect(client, rid, timeout=120)
                finished.append(rid)

            await asyncio.gather(*(follow(rid) for rid in [orphan, *rids]))
            return finished, orphan

    finished, orphan = run(main())
    assert len(finished) == behind + 1
    assert finished.index(orphan) < behind // 2, f"the orphan ended {finished.index(orphan) + 1}th"
