"""Jobs flowing through real workers: concurrent producers, and aborts."""

from __future__ import annotations

import asyncio
import time

import pytest

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import ControlReply, DeltaEvent, DoneEvent, Event, Usage
from mlx_redis_worker.local_redis import local_redis
from tests.daemon.helpers import check_stream, collect, log_length, pending_ids, settled
from tests.support.processes import WorkerFactory
from tests.support.prompts import random_prompts
from tests.support.references import GreedyReference
from tests.support.waiting import run, until

MAX_TOKENS = 12

Result = tuple[str, str, list[list[Event]]]  # prompt, request id, one stream per subscriber


@pytest.mark.timeout(120)
def test_concurrent_producers_get_greedy_texts_and_gapless_streams(
    workers: WorkerFactory, redis_url: str, prefix: str, reference: GreedyReference
) -> None:
    """20 jobs from 4 producers (each its own Client) over 2 workers of one group."""
    texts = random_prompts(20, seed=7)
    expected = dict(zip(texts, reference.texts(texts, MAX_TOKENS), strict=True))
    assert len(set(expected.values())) >= 15  # distinct answers: the comparison means something
    first = workers.start("w1", max_concurrency=8, wait=False)
    second = workers.start("w2", max_concurrency=8, wait=False)
    first.wait_ready()
    second.wait_ready()

    async def producer(mine: list[str], observer: Client) -> list[Result]:
        """Submit, follow each job live (own client and a shared observer client), then
        replay each finished one from its log (a late subscriber)."""
        async with Client(redis_url, prefix=prefix) as client:
            live = []
            for prompt in mine:
                rid = await client.submit(prompt, max_tokens=MAX_TOKENS, temperature=0.0)
                own = asyncio.create_task(collect(client, rid))
                watched = asyncio.create_task(collect(observer, rid))
                live.append((prompt, rid, own, watched))
            results = []
            for prompt, rid, own, watched in live:
                streams = [await own, await watched, await collect(client, rid)]
                results.append((prompt, rid, streams))
            return results

    async def main() -> tuple[list[Result], list[ControlReply]]:
        async with Client(redis_url, prefix=prefix) as observer:
            per_producer = await asyncio.gather(
                *(producer(texts[i::4], observer) for i in range(4))
            )
            await until(lambda: settled(observer), 10, "every entry acknowledged and deleted")
            replies = await observer.stats()
        return [r for results in per_producer for r in results], replies

    results, replies = run(main())
    assert len(results) == 20
    assert len({rid for _, rid, _ in results}) == 20
    for prompt, rid, streams in results:
        for events in streams:
            summary = check_stream(events, rid)
            assert isinstance(summary.terminal, DoneEvent), summary.terminal
            assert summary.terminal.finish_reason == "length"
            assert summary.terminal.usage.completion_tokens == MAX_TOKENS
            assert summary.resets == []
            assert summary.attempts == [1]
            assert summary.terminal.output_text == expected[prompt], prompt
            assert events == streams[0]  # every subscriber saw the very same events
    # Both workers took part.
    completed = {r.worker_id: r.result["jobs"]["outcomes"].get("completed", 0) for r in replies}
    assert sum(completed.values()) == 20, completed
    assert set(completed) == {"w1", "w2"}


@pytest.mark.timeout(180)
def test_an_abort_racing_the_job_s_start_gets_one_reply_and_ends_it(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    """Abort a job the moment it is queued, again and again: the abort meets the job waiting,
    being begun or running here. Each time the worker answers once, the stream ends with
    done(abort), and nothing stays pending (the abort's own attempt and the worker's delivery
    once both opened the request's events: no reply came and the job task failed)."""
    workers.start("w1", max_concurrency=1)

    async def main() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            for _ in range(200):
                rid = await client.submit("a long story", max_tokens=2000, temperature=0.0)
                replies = await client.abort(rid)
                assert len(replies) == 1 and replies[0].ok, replies
                ended = await client.wait(rid, timeout=60)
                assert isinstance(ended, DoneEvent) and ended.finish_reason == "abort", ended
            await until(lambda: settled(client), 30, "entries acknowledged and deleted")

    run(main())


@pytest.mark.timeout(120)
def test_abort_running_and_queued_jobs(workers: WorkerFactory, redis_url: str, prefix: str) -> None:
    """With one slot: abort a job that is still queued behind a long one (it never runs), then
    the running long one (its stream ends with done(abort)); both entries are acknowledged.
    A job past its deadline is not started either: done(expired)."""
    workers.start("w1", max_concurrency=1)

    async def main() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            running = await client.submit("a long story", max_tokens=2000, temperature=0.0)
            running_stream = asyncio.create_task(collect(client, running))
            await until(lambda: _has(client, running, 4), 30, "a few deltas of the long job")
            queued = await client.submit("never runs", max_tokens=50, temperature=0.0)
            queued_stream = asyncio.create_task(collect(client, queued))
            await asyncio.sleep(0.5)  # the worker has no free slot: it must not read it
            assert len(await pending_ids(client)) == 1
            replies = await client.abort(queued)
            # Nobody has begun it: the worker ends it where it waits, at once.
            assert [r.result for r in replies] == [{"aborted": True, "state": "queued"}]
            queued_events = await asyncio.wait_for(queued_stream, 1.0)
            assert not running_stream.done()  # the long job was not in the way

            replies = await client.abort(running)
            assert [r.result for r in replies] == [{"aborted": True, "state": "running"}]
            events = await asyncio.wait_for(running_stream, 30)
            summary = check_stream(events, running)
            assert isinstance(summary.terminal, DoneEvent)
            assert summary.terminal.finish_reason == "abort"
            assert 0 < summary.terminal.usage.completion_tokens < 2000
            assert summary.deltas

            summary = check_stream(queued_events, queued)
            assert isinstance(summary.terminal, DoneEvent)
            assert summary.terminal.finish_reason == "abort"
            assert summary.terminal.usage == Usage(prompt_tokens=0, completion_tokens=0)
            assert summary.terminal.output_text == ""
            assert not [e for e in queued_events if isinstance(e, DeltaEvent)]

            late = await client.submit("too late", max_tokens=50, deadline=time.time() - 1)
            events = await collect(client, late)
            assert [e.type for e in events] == ["queued", "done"]
            assert events[-1].finish_reason == "expired"
            assert events[-1].usage == Usage(prompt_tokens=0, completion_tokens=0)

            # All acknowledged (nothing pending) and deleted from the job stream.
            await until(lambda: settled(client), 10, "entries acknowledged and deleted")
            stats = await client.stats()
            outcomes = stats[0].result["jobs"]["outcomes"]
            # The queued job's entry, read once the slot was free, found its request ended.
            assert outcomes == {"completed": 1, "already_done": 1, "expired": 1}

    run(main())


@pytest.mark.timeout(120)
def test_an_abort_naming_another_model_is_ignored_by_this_models_worker(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    """Its command and its marker (which names the model) alike: a job of this worker's model
    runs to its end although an abort naming another model came first; an abort naming its own
    model stops it before it starts."""
    workers.start("w1", max_concurrency=1)

    async def main() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            # No worker serves "other": nobody answers, and the tiny worker does not act.
            assert await client.abort("spared", model="other", timeout=1.0) == []
            # The tiny worker does (the request is not queued yet: not_found), marker and all.
            for request_id, model in (("stopped", "tiny"), ("stopped-too", None)):
                (reply,) = await client.abort(request_id, model=model)
                assert reply.error is not None and reply.error.code == "not_found", reply
            ends: dict[str, DoneEvent] = {}
            for request_id in ("spared", "stopped", "stopped-too"):
                await client.submit("count", request_id=request_id, max_tokens=6, temperature=0)
                events = await collect(client, request_id)
                assert isinstance(events[-1], DoneEvent), events
                ends[request_id] = events[-1]
            assert ends["spared"].finish_reason == "length"
            assert ends["spared"].usage.completion_tokens == 6
            assert ends["stopped"].finish_reason == "abort"
            assert ends["stopped-too"].finish_reason == "abort"

            # A job waiting in the stream behind a running one: an abort naming its model is
            # answered "elsewhere" (a worker cannot tell the model of a job it does not hold);
            # the marker ends it once the worker takes it, before it runs.
            running = await client.submit("a long story", max_tokens=2000, temperature=0.0)
            await until(lambda: _has(client, running, 4), 30, "a few deltas of the long job")
            queued = await client.submit("never runs", max_tokens=50, temperature=0.0)
            replies = await client.abort(queued, model="tiny")
            assert [r.result for r in replies] == [{"aborted": False, "state": "elsewhere"}]
            replies = await client.abort(running, model="tiny")
            assert [r.result for r in replies] == [{"aborted": True, "state": "running"}]
            events = await collect(client, queued)
            assert isinstance(events[-1], DoneEvent) and events[-1].finish_reason == "abort"
            assert not [e for e in events if isinstance(e, DeltaEvent)]

    run(main())


async def _has(client: Client, request_id: str, deltas: int) -> bool:
    return await log_length(client, request_id) > deltas


@pytest.mark.timeout(120)
def test_a_worker_serves_through_the_embedded_redis(
    workers: WorkerFactory, prefix: str, reference: GreedyReference
) -> None:
    """The demo's last resort on a machine without Redis: fakeredis over TCP. A worker and a
    client must work through it as through redis-server (it answers some commands its own
    way, e.g. a bare HELLO resets the connection to RESP2)."""
    texts = random_prompts(3, seed=31)
    expected = reference.texts(texts, MAX_TOKENS)
    with local_redis(None, embedded=True) as (url, what):
        assert "fakeredis" in what
        workers.start("embedded-1", redis_url=url)

        async def main() -> list[list[Event]]:
            async with Client(url, prefix=prefix) as client:
                rids = [
                    await client.submit(text, max_tokens=MAX_TOKENS, temperature=0.0)
                    for text in texts
                ]
                return [await collect(client, rid) for rid in rids]

        streams = run(main())
    for text, events, greedy in zip(texts, streams, expected, strict=True):
        summary = check_stream(events, events[0].request_id)
        assert summary.final_text == greedy, text
