"""The publish+append script and BEGIN_ATTEMPT: order, idempotency by seq, holes, the fence."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from redis.asyncio import Redis

from mlx_redis_protocol import replay_log
from mlx_redis_protocol.codec_events import decode_event, encode_event
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.replay_log import (
    DUPLICATE,
    FINISHED,
    PUBLISH_EVENTS,
    PUBLISH_EVENTS_ON_NODE,
    REMEMBERED,
    STALE_ATTEMPT,
    Fence,
    Outcome,
    begin_attempt,
    last_seq,
    new_run,
    parse_fence,
    publish_events,
    read_log,
)
from tests.protocol.helpers import (
    begin,
    delta,
    done,
    emit,
    queued,
    reset,
    run_of,
    text_events,
)
from tests.support.waiting import run


def test_events_are_logged_and_published_in_order(redis_url: str, keys: Keys) -> None:
    events = text_events("r1", ["a", "b", "c"])

    async def scenario() -> tuple[list[Outcome], list[int], int, int, list[bytes]]:
        redis = Redis.from_url(redis_url)
        pubsub = redis.pubsub()
        try:
            await pubsub.subscribe(keys.out("r1"))
            await pubsub.get_message(timeout=2)  # the subscribe confirmation
            outcomes = await emit(redis, keys, *events)
            entries = await read_log(redis, keys, "r1")
            published = []
            while len(published) < len(events):
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
                assert message is not None, "a published event is missing"
                published.append(message["data"])
            assert published == [entry.data for entry in entries]
            return (
                outcomes,
                [entry.seq for entry in entries],
                await redis.ttl(keys.log("r1")),
                await last_seq(redis, keys, "r1"),
                published,
            )
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]
            await redis.aclose()

    outcomes, seqs, ttl, last, published = run(scenario())
    assert outcomes == [Outcome.LOGGED] * 4
    assert seqs == [1, 2, 3, 4]
    assert 590 <= ttl <= 600
    assert last == 4
    assert [decode_event(data) for data in published] == events


def test_a_repeated_call_writes_and_publishes_nothing_twice(redis_url: str, keys: Keys) -> None:
    """A call whose reply was lost (a timeout after it ran) is simply sent again: events whose
    seq the log holds are reported as logged, but neither appended nor published again; the
    rest of the call still goes through. Same for the producer's queued marker."""
    first_call = [queued("r4"), delta("r4", 1, "a"), done("r4", 2, "a")]

    async def scenario() -> tuple[list[Outcome], list[Outcome], list[int], list[int]]:
        redis = Redis.from_url(redis_url)
        pubsub = redis.pubsub()
        try:
            await pubsub.subscribe(keys.out("r4"))
            await pubsub.get_message(timeout=2)
            await emit(redis, keys, *first_call[:2])
            repeated = await emit(redis, keys, *first_call[:2])
            resent = await emit(redis, keys, *first_call)
            heard = []
            while (message := await pubsub.get_message(True, timeout=0.5)) is not None:
                heard.append(decode_event(message["data"]).seq)
            seqs = [entry.seq for entry in await read_log(redis, keys, "r4")]
            return repeated, resent, seqs, heard
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]
            await redis.aclose()

    repeated, resent, seqs, heard = run(scenario())
    assert repeated == [Outcome.LOGGED, Outcome.LOGGED]
    assert resent == [Outcome.LOGGED] * 3
    assert seqs == [0, 1, 2]
    assert heard == [0, 1, 2]


def test_events_after_a_hole_in_the_log_are_refused(redis_url: str, keys: Keys) -> None:
    """A log that lost its newest entries (a failover to a replica that had not received
    them) must not get events after the hole: subscribers would wait forever for the missing
    seq. The attempt is refused with LOG_GAP; a log that is gone altogether starts afresh."""

    async def scenario() -> tuple[list[Outcome], list[int], list[Outcome]]:
        redis = Redis.from_url(redis_url)
        try:
            await emit(redis, keys, delta("r5", 1, "a"), delta("r5", 2, "b"))
            newest = (await redis.xrevrange(keys.log("r5"), count=1))[0][0]
            await redis.xdel(keys.log("r5"), newest)  # seq 2 is lost
            after_hole = await emit(redis, keys, delta("r5", 3, "c"), done("r5", 4, ""))
            seqs = [entry.seq for entry in await read_log(redis, keys, "r5")]
            await redis.delete(keys.log("r5"))
            afresh = await emit(redis, keys, delta("r5", 5, "d"))
            return after_hole, seqs, afresh
        finally:
            await redis.aclose()

    after_hole, seqs, afresh = run(scenario())
    assert after_hole == [Outcome.LOG_GAP, Outcome.LOG_GAP]
    assert seqs == [1]
    assert afresh == [Outcome.LOGGED]


def test_single_event_on_a_client_after_script_flush(redis_url: str, keys: Keys) -> None:
    async def scenario() -> list[int]:
        redis = Redis.from_url(redis_url)
        try:
            await redis.script_flush()
            await emit(redis, keys, delta("r2", 1, "x"))
            await redis.script_flush()
            await emit(redis, keys, delta("r2", 2, "y"), delta("r2", 3, "z"))
            return [entry.seq for entry in await read_log(redis, keys, "r2")]
        finally:
            await redis.aclose()

    assert run(scenario()) == [1, 2, 3]


def test_ttl_must_be_positive(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        redis = Redis.from_url(redis_url)
        try:
            await publish_events(redis, keys, [delta("r3", 1, "x")], ttl_seconds=0)
        finally:
            await redis.aclose()

    with pytest.raises(ValueError):
        run(scenario())


def test_a_begun_attempt_fences_off_older_ones(redis_url: str, keys: Keys) -> None:
    """BEGIN_ATTEMPT returns the seq to continue from; afterwards a stale attempt's events are
    refused (nothing appended, nothing published), and a stale begin is refused too."""

    async def scenario() -> tuple[int, int, list[int], list[int]]:
        redis = Redis.from_url(redis_url)
        try:
            first = await begin(redis, keys, "r9", 1)
            await emit(redis, keys, delta("r9", 1, "a"), delta("r9", 2, "b"))
            taken_over_at = await begin(redis, keys, "r9", 2)
            # The stalled attempt 1 wakes up and flushes: refused.
            stalled = await publish_events(
                redis, keys, [delta("r9", 3, "c", attempt=1)], runs={"r9": run_of(1)}
            )
            stale = await begin(redis, keys, "r9", 1)
            await emit(redis, keys, delta("r9", 3, "C", attempt=2))
            entries = await read_log(redis, keys, "r9")
            attempts = [decode_event(e.data).attempt for e in entries]
            assert stalled == [Outcome.FENCED]
            return first, taken_over_at, [e.seq for e in entries], [*attempts, stale]
        finally:
            await redis.aclose()

    first, taken_over_at, seqs, attempts = run(scenario())
    assert first == 0 and taken_over_at == 2
    assert seqs == [1, 2, 3]
    assert attempts == [1, 1, 2, STALE_ATTEMPT]


def test_only_the_run_that_began_an_attempt_writes_for_it(redis_url: str, keys: Keys) -> None:
    """Two runs can carry one attempt number: after a failover that lost a delivery (and the
    begin after it), the job is delivered again as attempt 1 while the first run still works.
    The fence names the run, not just the attempt: the run whose begin is gone is refused,
    the one that began last writes. The fence lives until the request ends, then gets the
    log's TTL (a long prefill that publishes nothing for a while keeps it)."""

    async def scenario() -> tuple[list[Outcome], list[Outcome], list[Outcome], int, int]:
        redis = Redis.from_url(redis_url)
        try:
            await emit(redis, keys, queued("r12"))
            # Run A began on a master that died before replicating it: no fence here.
            lost_begin = await publish_events(
                redis, keys, [delta("r12", 1, "a")], runs={"r12": "run-a"}
            )
            assert await begin_attempt(redis, keys, "r12", 1, 600, "run-b") == 0
            running_ttl = await redis.ttl(keys.attempt("r12"))
            superseded = await publish_events(
                redis, keys, [delta("r12", 1, "a")], runs={"r12": "run-a"}
            )
            owner = await publish_events(
                redis, keys, [delta("r12", 1, "b"), done("r12", 2, "b")], runs={"r12": "run-b"}
            )
            return lost_begin, superseded, owner, running_ttl, await redis.ttl(keys.attempt("r12"))
        finally:
            await redis.aclose()

    lost_begin, superseded, owner, running_ttl, ended_ttl = run(scenario())
    assert lost_begin == [Outcome.FENCED]
    assert superseded == [Outcome.FENCED]
    assert owner == [Outcome.LOGGED, Outcome.LOGGED]
    assert running_ttl == -1  # no expiry while the request runs
    assert 590 <= ended_ttl <= 600


def test_a_finished_log_refuses_a_new_attempt(redis_url: str, keys: Keys) -> None:
    """Once the log ends with a terminal event, BEGIN_ATTEMPT answers FINISHED and fences
    nothing (so the finished attempt's bookkeeping stands and no second ending can follow)."""

    async def scenario() -> tuple[int, int, bytes | None, int]:
        redis = Redis.from_url(redis_url)
        try:
            await emit(redis, keys, delta("r10", 1, "a"), done("r10", 2, "a"))
            again = await begin(redis, keys, "r10", 2)
            attempt_key = await redis.get(keys.attempt("r10"))
            # A log whose last entry is not terminal (a reset, say) may be continued.
            await emit(redis, keys, delta("r11", 1, "a"))
            continued = await begin(redis, keys, "r11", 2)
            return again, len(await read_log(redis, keys, "r10")), attempt_key, continued
        finally:
            await redis.aclose()

    again, entries, attempt_key, continued = run(scenario())
    assert again == FINISHED
    assert entries == 2 and attempt_key == f"1 {run_of(1)}".encode()
    assert continued == 1


def test_one_call_writes_many_requests_and_fences_each_on_its_own(
    redis_url: str, keys: Keys
) -> None:
    """One PUBLISH_EVENTS call carries a step's events of several requests; a fenced request's
    event is refused while the others in the same call are written."""

    async def scenario() -> tuple[list[Outcome], list[int], list[int]]:
        redis = Redis.from_url(redis_url)
        try:
            for rid in ("ok-a", "fenced", "ok-b"):
                await begin(redis, keys, rid, 1)
            await begin(redis, keys, "fenced", 2)  # attempt 1 has been taken over
            written = await publish_events(
                redis,
                keys,
                [delta("ok-a", 1, "x"), delta("fenced", 1, "y", attempt=1), done("ok-b", 1, "z")],
                runs={rid: run_of(1) for rid in ("ok-a", "fenced", "ok-b")},
            )
            logs = [len(await read_log(redis, keys, rid)) for rid in ("ok-a", "fenced", "ok-b")]
            ends = [await begin(redis, keys, rid, 2) for rid in ("ok-a", "ok-b")]
            return written, logs, ends
        finally:
            await redis.aclose()

    written, logs, ends = run(scenario())
    assert written == [Outcome.LOGGED, Outcome.FENCED, Outcome.LOGGED]
    assert logs == [1, 0, 1]
    assert ends == [1, FINISHED]  # only ok-b's entry carries the terminal mark


def test_the_spec_lists_the_script_the_code_runs() -> None:
    """protocol/README.md shows PUBLISH_EVENTS for implementers in other languages: it must
    be the script itself, not a paraphrase that drifted."""
    readme = (Path(replay_log.__file__).parents[1] / "README.md").read_text()
    listing = readme.split("```lua\n", 1)[1].split("```", 1)[0]
    assert textwrap.dedent(listing) == PUBLISH_EVENTS.lstrip("\n")


def test_the_spec_lists_the_cluster_nodes_prologue_the_code_runs() -> None:
    """The spec's per-node prologue is the one the code puts before PUBLISH_EVENTS."""
    readme = (Path(replay_log.__file__).parents[1] / "README.md").read_text()
    listing = readme.split("```\n   #!lua", 1)[1].split("```", 1)[0]
    prologue = textwrap.dedent("   #!lua" + listing).removesuffix("-- then the script above\n")
    assert prologue + PUBLISH_EVENTS == PUBLISH_EVENTS_ON_NODE


def test_queued_markers_after_the_end_neither_hide_it_nor_renumber(
    redis_url: str, keys: Keys
) -> None:
    """A producer re-submitting a finished request appends a queued marker with a plain XADD
    (as the spec's worked example does): the request still reads as finished, and numbering
    still continues from the worker's newest event, not from the marker's seq 0."""
    marker = encode_event(queued("r1"))

    async def plain_marker(redis: Redis, request_id: str) -> None:
        await redis.xadd(keys.log(request_id), {"seq": "0", "e": marker})

    async def scenario() -> tuple[int, int, int, list[Outcome], list[int]]:
        redis = Redis.from_url(redis_url)
        try:
            await plain_marker(redis, "r1")
            await emit(redis, keys, *text_events("r1", ["a", "b"]))
            await plain_marker(redis, "r1")
            await plain_marker(redis, "r1")
            finished = await begin(redis, keys, "r1", 1)
            redelivered = await begin(redis, keys, "r1", 2)
            # Unfinished: markers after a worker's event (the job re-submitted while it runs).
            await emit(redis, keys, delta("r2", 1, "x"))
            await plain_marker(redis, "r2")
            assert await last_seq(redis, keys, "r2") == 1
            continued = await begin(redis, keys, "r2", 2)
            outcomes = await emit(redis, keys, reset("r2", 2, 2), delta("r2", 3, "y", 2))
            seqs = [entry.seq for entry in await read_log(redis, keys, "r2")]
            return finished, redelivered, continued, outcomes, seqs
        finally:
            await redis.aclose()

    finished, redelivered, continued, outcomes, seqs = run(scenario())
    assert (finished, redelivered) == (FINISHED, FINISHED)
    assert continued == 1
    assert outcomes == [Outcome.LOGGED, Outcome.LOGGED]
    assert seqs == [1, 0, 2, 3]


def test_begin_if_free_takes_only_a_request_nobody_began(redis_url: str, keys: Keys) -> None:
    """The abort of a waiting job ends it only if no worker has begun it: a begun request
    answers STALE_ATTEMPT, a free one is fenced for the caller, a finished one FINISHED."""

    async def scenario() -> tuple[int, int, int, bytes | None]:
        redis = Redis.from_url(redis_url)
        try:
            await emit(redis, keys, queued("free"), queued("begun"), queued("ended"))
            await begin(redis, keys, "begun", 1)
            await emit(redis, keys, *text_events("ended", ["z"]))
            free = await begin_attempt(redis, keys, "free", 1, 600, "aborter", if_free=True)
            begun = await begin_attempt(redis, keys, "begun", 1, 600, "aborter", if_free=True)
            ended = await begin_attempt(redis, keys, "ended", 1, 600, "aborter", if_free=True)
            return free, begun, ended, await redis.get(keys.attempt("begun"))
        finally:
            await redis.aclose()

    free, begun, ended, fence = run(scenario())
    assert (free, begun, ended) == (0, STALE_ATTEMPT, FINISHED)
    assert fence == f"1 {run_of(1)}".encode()  # the worker that began it keeps it


def test_begin_if_fence_takes_over_from_that_run_only(redis_url: str, keys: Keys) -> None:
    """The abort of a job whose worker died: the new attempt takes the fence only while it is
    exactly the dead run's, not one that a reclaiming worker began meanwhile."""
    dead = b"1 gone-worker/abc"

    async def scenario() -> tuple[int, int, bytes | None]:
        redis = Redis.from_url(redis_url)
        try:
            await emit(redis, keys, queued("r1"))
            await redis.set(keys.attempt("r1"), dead)
            taken = await begin_attempt(redis, keys, "r1", 2, 600, "me/1", if_fence=dead)
            again = await begin_attempt(redis, keys, "r1", 3, 600, "me/2", if_fence=dead)
            return taken, again, await redis.get(keys.attempt("r1"))
        finally:
            await redis.aclose()

    taken, again, fence = run(scenario())
    assert (taken, again) == (0, STALE_ATTEMPT)
    assert fence == b"2 me/1"
    parsed = parse_fence(dead)
    assert parsed is not None and (parsed.attempt, parsed.worker_id) == (1, "gone-worker")
    assert parse_fence(b"1 tokenwithoutworker") == Fence(b"1 tokenwithoutworker", 1, None)
    assert parse_fence(b"garbage") is None and parse_fence(None) is None
    assert new_run("w-1").startswith("w-1/")


def test_begin_refuses_a_second_entry_of_a_request_whatever_its_attempt(
    redis_url: str, keys: Keys
) -> None:
    """Two job entries of one request (queued twice): the run of the entry that holds the
    fence owns the request. The other entry's run is refused with DUPLICATE, whether its
    delivery count is the same or higher (counts of two entries are unrelated), so two runs
    never share an attempt; a redelivery of the owning entry takes over as before, and once
    the request ended every entry is FINISHED."""

    async def scenario() -> tuple[int, ...]:
        redis = Redis.from_url(redis_url)
        try:
            await emit(redis, keys, queued("twice"))
            first = await begin_attempt(redis, keys, "twice", 1, 600, new_run("w1", "10-0"))
            second = await begin_attempt(redis, keys, "twice", 1, 600, new_run("w2", "11-0"))
            later = await begin_attempt(redis, keys, "twice", 5, 600, new_run("w2", "11-0"))
            again = await begin_attempt(redis, keys, "twice", 2, 600, new_run("w2", "10-0"))
            fence = parse_fence(await redis.get(keys.attempt("twice")))
            assert fence is not None and (fence.worker_id, fence.entry_id) == ("w2", "10-0")
            await emit(redis, keys, reset("twice", 1, 2), done("twice", 2, "x", attempt=2))
            ended = await begin_attempt(redis, keys, "twice", 1, 600, new_run("w1", "11-0"))
            return first, second, later, again, ended
        finally:
            await redis.aclose()

    assert run(scenario()) == (0, DUPLICATE, DUPLICATE, 0, FINISHED)
    parsed = parse_fence(b"3 w-1/1712-0/abc")
    assert parsed == Fence(b"3 w-1/1712-0/abc", 3, "w-1", "1712-0")


def test_begin_refuses_a_request_remembered_as_finished_after_its_log_expired(
    redis_url: str, keys: Keys
) -> None:
    """The finished marker outlives the log: a request queued again after its log expired
    (only the new queued marker in the log) is REMEMBERED, not run; an ending in the log
    still answers FINISHED first; without the marker the request is new."""

    async def scenario() -> tuple[int, int, int]:
        redis = Redis.from_url(redis_url)
        try:
            await emit(redis, keys, queued("again"), queued("ended"), queued("fresh"))
            await redis.set(keys.finished("again"), b"1", ex=86400)
            await emit(redis, keys, *text_events("ended", ["z"]))
            await redis.set(keys.finished("ended"), b"1", ex=86400)
            again = await begin_attempt(redis, keys, "again", 1, 600, new_run("w", "1-0"))
            ended = await begin_attempt(redis, keys, "ended", 1, 600, new_run("w", "2-0"))
            fresh = await begin_attempt(redis, keys, "fresh", 1, 600, new_run("w", "3-0"))
            assert await redis.get(keys.attempt("again")) is None  # nothing fenced
            return again, ended, fresh
        finally:
            await redis.aclose()

    assert run(scenario()) == (REMEMBERED, FINISHED, 0)
