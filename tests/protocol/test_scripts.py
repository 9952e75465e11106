"""The publish+append script: through a caller's pipeline, a plain client, after SCRIPT FLUSH."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from protocol.codec import decode_event
from protocol.keys import Keys
from protocol.scripts import (
    FINISHED,
    STALE_ATTEMPT,
    begin_attempt,
    last_seq,
    publish_events,
    read_log,
)
from tests.protocol.helpers import delta, done, run, text_events


@pytest.mark.parametrize("transaction", [False, True])
def test_events_queued_on_a_callers_pipeline(redis_url: str, keys: Keys, transaction: bool) -> None:
    events = text_events("r1", ["a", "b", "c"])

    async def scenario() -> tuple[list[int], int, int, list[bytes]]:
        redis = Redis.from_url(redis_url)
        pubsub = redis.pubsub()
        try:
            await pubsub.subscribe(keys.out("r1"))
            await pubsub.get_message(timeout=2)  # the subscribe confirmation
            await redis.script_flush()  # the pipeline must load the script itself
            async with redis.pipeline(transaction=transaction) as pipeline:
                await publish_events(pipeline, keys, events, ttl_seconds=120)
                pipeline.set(f"{keys.prefix}:other", b"batched in the same round trip")
                await pipeline.execute()
            entries = await read_log(redis, keys, "r1")
            published = []
            while len(published) < len(events):
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
                assert message is not None, "a published event is missing"
                published.append(message["data"])
            assert published == [entry.data for entry in entries]
            return (
                [entry.seq for entry in entries],
                await redis.ttl(keys.log("r1")),
                await last_seq(redis, keys, "r1"),
                published,
            )
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]
            await redis.aclose()

    seqs, ttl, last, published = run(scenario())
    assert seqs == [1, 2, 3, 4]
    assert 110 <= ttl <= 120
    assert last == 4
    assert [decode_event(data) for data in published] == events


def test_single_event_on_a_client_after_script_flush(redis_url: str, keys: Keys) -> None:
    async def scenario() -> list[int]:
        redis = Redis.from_url(redis_url)
        try:
            await redis.script_flush()
            await publish_events(redis, keys, [delta("r2", 1, "x")])
            await redis.script_flush()
            await publish_events(redis, keys, [delta("r2", 2, "y"), delta("r2", 3, "z")])
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
            first = await begin_attempt(redis, keys, "r9", 1, 120)
            await publish_events(redis, keys, [delta("r9", 1, "a"), delta("r9", 2, "b")])
            taken_over_at = await begin_attempt(redis, keys, "r9", 2, 120)
            # The stalled attempt 1 wakes up and flushes: refused.
            await publish_events(redis, keys, [delta("r9", 3, "c", attempt=1)])
            stale = await begin_attempt(redis, keys, "r9", 1, 120)
            await publish_events(redis, keys, [delta("r9", 3, "C", attempt=2)])
            entries = await read_log(redis, keys, "r9")
            attempts = [decode_event(e.data).attempt for e in entries]
            return first, taken_over_at, [e.seq for e in entries], [*attempts, stale]
        finally:
            await redis.aclose()

    first, taken_over_at, seqs, attempts = run(scenario())
    assert first == 0 and taken_over_at == 2
    assert seqs == [1, 2, 3]
    assert attempts == [1, 1, 2, STALE_ATTEMPT]


def test_a_finished_log_refuses_a_new_attempt(redis_url: str, keys: Keys) -> None:
    """Once the log ends with a terminal event, BEGIN_ATTEMPT answers FINISHED and fences
    nothing (so the finished attempt's bookkeeping stands and no second ending can follow)."""

    async def scenario() -> tuple[int, int, bytes | None, int]:
        redis = Redis.from_url(redis_url)
        try:
            await begin_attempt(redis, keys, "r10", 1, 120)
            await publish_events(redis, keys, [delta("r10", 1, "a"), done("r10", 2, "a")])
            again = await begin_attempt(redis, keys, "r10", 2, 120)
            attempt_key = await redis.get(keys.attempt("r10"))
            # A log whose last entry is not terminal (a reset, say) may be continued.
            await begin_attempt(redis, keys, "r11", 1, 120)
            await publish_events(redis, keys, [delta("r11", 1, "a")])
            continued = await begin_attempt(redis, keys, "r11", 2, 120)
            return again, len(await read_log(redis, keys, "r10")), attempt_key, continued
        finally:
            await redis.aclose()

    again, entries, attempt_key, continued = run(scenario())
    assert again == FINISHED
    assert entries == 2 and attempt_key == b"1"
    assert continued == 1


def test_one_call_writes_many_requests_and_fences_each_on_its_own(
    redis_url: str, keys: Keys
) -> None:
    """One PUBLISH_EVENTS call carries a step's events of several requests; a fenced request's
    event is refused (False) while the others in the same call are written."""

    async def scenario() -> tuple[list[bool], list[int], list[int]]:
        redis = Redis.from_url(redis_url)
        try:
            await begin_attempt(redis, keys, "fenced", 2, 120)  # attempt 1 has been taken over
            written = await publish_events(
                redis,
                keys,
                [delta("ok-a", 1, "x"), delta("fenced", 1, "y", attempt=1), done("ok-b", 1, "z")],
            )
            logs = [len(await read_log(redis, keys, rid)) for rid in ("ok-a", "fenced", "ok-b")]
            ends = [await begin_attempt(redis, keys, rid, 2, 120) for rid in ("ok-a", "ok-b")]
            return written, logs, ends
        finally:
            await redis.aclose()

    written, logs, ends = run(scenario())
    assert written == [True, False, True]
    assert logs == [1, 0, 1]
    assert ends == [1, FINISHED]  # only ok-b's entry carries the terminal mark
