"""The subscriber merge against a real Redis: every seq exactly once, in order, whenever the
subscriber arrives and however the channel misbehaves."""

from __future__ import annotations

import asyncio
import random
from contextlib import aclosing

import pytest
from redis.asyncio import Redis

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.errors import RequestExpired, RequestNotFound, StreamTimeout
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import DoneEvent, Event, QueuedEvent, ResetEvent
from mlx_redis_protocol.replay_log import last_seq
from tests.protocol.helpers import (
    append_only,
    delta,
    done,
    emit,
    publish_only,
    reset,
    text_events,
)
from tests.support.waiting import run

PIECES = ["Hel", "lo", ", ", "wor", "ld"]


def make_client(redis_url: str, prefix: str, **options: float) -> Client:
    return Client(redis_url, prefix=prefix, recheck_interval=options.pop("recheck", 0.2))


async def collect(
    client: Client, request_id: str, started: asyncio.Event | None = None
) -> list[Event]:
    """All events of a request; sets ``started`` once the subscriber has its first event."""
    events: list[Event] = []
    async with aclosing(client.stream(request_id, timeout=5)) as stream:
        async for event in stream:
            events.append(event)
            if started is not None:
                started.set()
    return events


async def subscribed(client: Client, request_id: str) -> asyncio.Task[list[Event]]:
    """A subscriber of the request, running, once it has read the queued marker."""
    started = asyncio.Event()
    subscriber = asyncio.create_task(collect(client, request_id, started))
    await asyncio.wait_for(started.wait(), 5)
    return subscriber


def assert_complete(events: list[Event], expected_last_seq: int) -> None:
    assert isinstance(events[0], QueuedEvent)
    assert [event.seq for event in events] == list(range(expected_last_seq + 1))
    assert isinstance(events[-1], DoneEvent)


def test_subscriber_arrives_before_the_job_starts(redis_url: str, prefix: str) -> None:
    async def scenario() -> list[Event]:
        async with make_client(redis_url, prefix) as client:
            request_id = await client.submit("hi")
            subscriber = await subscribed(client, request_id)
            for event in text_events(request_id, PIECES):
                await emit(client.redis, client.keys, event)
            return await asyncio.wait_for(subscriber, 5)

    events = run(scenario())
    assert_complete(events, len(PIECES) + 1)
    assert "".join(e.new_text for e in events if hasattr(e, "new_text")) == "Hello, world"


def test_subscriber_arrives_during_the_job(redis_url: str, prefix: str) -> None:
    async def scenario() -> list[Event]:
        async with make_client(redis_url, prefix) as client:
            request_id = await client.submit("hi")
            events = text_events(request_id, PIECES)
            await emit(client.redis, client.keys, *events[:3])
            subscriber = await subscribed(client, request_id)
            for event in events[3:]:
                await emit(client.redis, client.keys, event)
            return await asyncio.wait_for(subscriber, 5)

    assert_complete(run(scenario()), len(PIECES) + 1)


def test_subscriber_arrives_after_the_job_is_done(redis_url: str, prefix: str) -> None:
    async def scenario() -> list[Event]:
        async with make_client(redis_url, prefix) as client:
            request_id = await client.submit("hi")
            await emit(client.redis, client.keys, *text_events(request_id, PIECES))
            return await collect(client, request_id)

    assert_complete(run(scenario()), len(PIECES) + 1)


def test_duplicated_deliveries_are_yielded_once(redis_url: str, prefix: str) -> None:
    async def scenario() -> list[Event]:
        async with make_client(redis_url, prefix) as client:
            request_id = await client.submit("hi")
            subscriber = await subscribed(client, request_id)
            for event in text_events(request_id, PIECES):
                await emit(client.redis, client.keys, event, event)  # logged and sent twice
                await publish_only(client.redis, client.keys, event)  # and a third time
            return await asyncio.wait_for(subscriber, 5)

    assert_complete(run(scenario()), len(PIECES) + 1)


def test_reordered_live_deliveries_come_out_in_order(redis_url: str, prefix: str) -> None:
    async def scenario() -> list[Event]:
        async with make_client(redis_url, prefix, recheck=30) as client:
            request_id = await client.submit("hi")
            events = text_events(request_id, PIECES)
            subscriber = await subscribed(client, request_id)
            await emit(client.redis, client.keys, events[0])
            # The log gets 2 and 3 in order; the channel delivers 3 before 2.
            await append_only(client.redis, client.keys, events[1])
            await append_only(client.redis, client.keys, events[2])
            await publish_only(client.redis, client.keys, events[2])
            await publish_only(client.redis, client.keys, events[1])
            await emit(client.redis, client.keys, *events[3:])
            # recheck=30: only the gap-triggered log read can have filled seq 2 in time.
            return await asyncio.wait_for(subscriber, 5)

    assert_complete(run(scenario()), len(PIECES) + 1)


def test_a_live_event_after_a_gap_pulls_the_gap_from_the_log(redis_url: str, prefix: str) -> None:
    async def scenario() -> list[Event]:
        async with make_client(redis_url, prefix, recheck=30) as client:
            request_id = await client.submit("hi")
            events = text_events(request_id, PIECES)
            subscriber = await subscribed(client, request_id)
            # Seq 1 and 2 are logged but their publishes are lost; seq 3 arrives live.
            await append_only(client.redis, client.keys, events[0])
            await append_only(client.redis, client.keys, events[1])
            await emit(client.redis, client.keys, *events[2:])
            return await asyncio.wait_for(subscriber, 5)

    assert_complete(run(scenario()), len(PIECES) + 1)


def test_a_lost_publish_is_recovered_from_the_log_while_idle(redis_url: str, prefix: str) -> None:
    async def scenario() -> list[Event]:
        async with make_client(redis_url, prefix, recheck=0.1) as client:
            request_id = await client.submit("hi")
            subscriber = await subscribed(client, request_id)
            for event in text_events(request_id, PIECES):  # logged, never published
                await append_only(client.redis, client.keys, event)
            return await asyncio.wait_for(subscriber, 5)

    assert_complete(run(scenario()), len(PIECES) + 1)


async def _log_reads(redis: Redis) -> int:
    """XRANGE calls the server has served so far (a follower reads the log with it)."""
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_xrange", {}).get("calls", 0))


def test_a_stream_heard_in_order_is_not_read_again_from_the_log(
    redis_url: str, prefix: str
) -> None:
    """The idle re-read is for a channel gone quiet: while every event arrives live and in
    order, the follower does not fetch and decode them all a second time from the log."""

    async def scenario() -> tuple[list[Event], int]:
        async with make_client(redis_url, prefix, recheck=0.3) as client:
            request_id = await client.submit("hi")
            events = text_events(request_id, [f"{i} " for i in range(59)])
            subscriber = await subscribed(client, request_id)
            before = await _log_reads(client.redis)
            for event in events:  # over 1.2 s of live events: four recheck intervals
                await emit(client.redis, client.keys, event)
                await asyncio.sleep(0.02)
            received = await asyncio.wait_for(subscriber, 5)
            return received, await _log_reads(client.redis) - before

    events, log_reads = run(scenario())
    assert_complete(events, 60)
    # Re-reading every interval made it 4 or more; one is the allowance for a loaded machine
    # that stalls this test past an interval between two events.
    assert log_reads <= 1, log_reads


def test_random_interleavings_of_channel_and_log(redis_url: str, prefix: str) -> None:
    """Many subscribers joining at random moments while the channel repeats and reorders."""
    rng = random.Random(1234)

    async def scenario() -> list[list[Event]]:
        async with make_client(redis_url, prefix, recheck=0.1) as client:
            request_id = await client.submit("hi")
            events = text_events(request_id, [f"t{i} " for i in range(30)])
            subscribers = []
            for index, event in enumerate(events):
                if index % 5 == 0:
                    subscribers.append(asyncio.create_task(collect(client, request_id)))
                await append_only(client.redis, client.keys, event)
                # The channel repeats, reorders and drops some of what was logged so far.
                logged = events[max(0, index - 3) : index + 1]
                for echo in rng.sample(logged, rng.randint(0, len(logged))):
                    await publish_only(client.redis, client.keys, echo)
                await asyncio.sleep(rng.random() * 0.005)
            subscribers.append(asyncio.create_task(collect(client, request_id)))
            return list(await asyncio.wait_for(asyncio.gather(*subscribers), 10))

    for events in run(scenario()):
        assert_complete(events, 31)


def test_reset_continues_the_seq_and_is_yielded(redis_url: str, prefix: str) -> None:
    async def scenario() -> tuple[list[Event], DoneEvent, int]:
        async with make_client(redis_url, prefix) as client:
            request_id = await client.submit("hi")
            redis, keys = client.redis, client.keys
            await emit(redis, keys, delta(request_id, 1, "first "), delta(request_id, 2, "try"))
            # The worker died; the job is redelivered and its new worker continues the seq.
            seq = await last_seq(redis, keys, request_id)
            await emit(
                redis,
                keys,
                reset(request_id, seq + 1, attempt=2),
                delta(request_id, seq + 2, "second", attempt=2),
                done(request_id, seq + 3, "second", attempt=2),
            )
            final = await client.wait(request_id, timeout=5)
            assert isinstance(final, DoneEvent)
            return await collect(client, request_id), final, seq

    events, final, seq_before_reset = run(scenario())
    assert seq_before_reset == 2
    assert [event.seq for event in events] == [0, 1, 2, 3, 4, 5]
    assert isinstance(events[3], ResetEvent) and events[3].attempt == 2
    assert final.output_text == "second" and final.attempt == 2


def test_unknown_request_is_not_found(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with make_client(redis_url, prefix) as client:
            await collect(client, "never-submitted")

    with pytest.raises(RequestNotFound, match="never-submitted"):
        run(scenario())


def test_expired_log_is_not_found(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with make_client(redis_url, prefix) as client:
            request_id = await client.submit("hi")
            await emit(client.redis, client.keys, *text_events(request_id, PIECES))
            await client.redis.delete(client.keys.log(request_id))  # as the TTL would
            await collect(client, request_id)

    with pytest.raises(RequestNotFound):
        run(scenario())


def test_log_expiring_while_waiting_is_not_found(redis_url: str, prefix: str) -> None:
    """Its TTL runs out (a 1 s log TTL): expired, not lost (tests/protocol/
    test_lost_or_expired.py has the lost case)."""

    async def scenario() -> None:
        async with Client(redis_url, prefix=prefix, log_ttl=1, recheck_interval=0.05) as client:
            request_id = await client.submit("hi")
            subscriber = await subscribed(client, request_id)
            await asyncio.wait_for(subscriber, 5)

    with pytest.raises(RequestExpired, match="its log expired"):
        run(scenario())


def test_log_has_the_configured_ttl(redis_url: str, prefix: str) -> None:
    async def scenario() -> tuple[int, int]:
        async with Client(redis_url, prefix=prefix, log_ttl=77) as client:
            request_id = await client.submit("hi")
            queued_ttl = await client.redis.ttl(client.keys.log(request_id))
            await emit(client.redis, client.keys, delta(request_id, 1, "x"))
            return queued_ttl, await client.redis.ttl(client.keys.log(request_id))

    queued_ttl, event_ttl = run(scenario())
    assert 70 <= queued_ttl <= 77
    assert 500 <= event_ttl <= 600  # the worker's publish_events default


def test_no_event_within_the_timeout(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with make_client(redis_url, prefix) as client:
            request_id = await client.submit("hi")
            async with aclosing(client.stream(request_id, timeout=0.3)) as stream:
                async for _event in stream:
                    pass

    with pytest.raises(StreamTimeout):
        run(scenario())


def test_leaving_a_stream_early_releases_the_subscription(redis_url: str, prefix: str) -> None:
    async def scenario() -> int:
        async with make_client(redis_url, prefix) as client:
            request_id = await client.submit("hi")
            async with aclosing(client.stream(request_id)) as stream:
                async for _event in stream:
                    break
            probe = Redis.from_url(redis_url)
            try:
                channels = await probe.pubsub_numsub(client.keys.out(request_id))
            finally:
                await probe.aclose()
            return int(channels[0][1])

    assert run(scenario()) == 0


def test_last_seq_of_missing_and_queued_logs(redis_url: str, keys: Keys) -> None:
    async def scenario() -> tuple[int, int]:
        async with Client(redis_url, prefix=keys.prefix) as client:
            missing = await last_seq(client.redis, keys, "nothing-here")
            request_id = await client.submit("hi")
            return missing, await last_seq(client.redis, keys, request_id)

    assert run(scenario()) == (0, 0)


def test_cancelling_a_stream_always_ends_it(redis_url: str, prefix: str) -> None:
    """Cancelled at random moments (also mid-command), a stream never keeps running."""

    async def scenario() -> int:
        async with make_client(redis_url, prefix, recheck=0.001) as client:
            request_id = await client.submit("hi")
            ended = 0
            for attempt in range(40):
                task = asyncio.create_task(collect(client, request_id))
                await asyncio.sleep(attempt * 0.0005)
                task.cancel()
                finished, _ = await asyncio.wait([task], timeout=3)
                ended += len(finished)
            return ended

    assert run(scenario()) == 40
