"""Jobs that can never run end in the dead-letter stream, and the worker keeps serving."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.codec_job import encode_job
from mlx_redis_protocol.constants import JOB_FIELD
from mlx_redis_protocol.messages import DoneEvent, ErrorEvent, Job, QueuedEvent, ResetEvent, Usage
from mlx_redis_protocol.replay_log import publish_events
from mlx_redis_protocol.wire import pack
from tests.daemon.helpers import check_stream, collect, log_length, settled
from tests.protocol.helpers import emit
from tests.support.processes import MODEL, WorkerFactory
from tests.support.prompts import random_prompts
from tests.support.waiting import run, until

MAX_TOKENS = 12


async def _dead_entries(client: Client) -> list[dict[str, Any]]:
    """The dead letters of the test model's stream, where every job of these tests runs."""
    entries = await client.redis.xrange(client.keys.model_stream(MODEL).dead, "-", "+")
    return [{key.decode(): value for key, value in fields.items()} for _entry_id, fields in entries]


@pytest.mark.timeout(120)
def test_poison_job_is_dead_lettered_after_max_deliveries_while_others_flow(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    """A job that already "failed" 3 deliveries on a ghost consumer: the worker
    (--max-deliveries 3) reclaims it as delivery 4, dead-letters it with a reason and tells
    its subscribers (reset, then error dead_lettered); the jobs around it complete.

    Also idempotency: a job the ghost finished (done in its log) but never acknowledged is
    reclaimed and only acknowledged: not run again, no event added.

    Jobs run, and count their deliveries, on the model's stream: the ghost's two jobs are
    queued there (no worker serves the model yet, hence ``require_worker=False``); the others
    go to the default stream and are forwarded."""

    async def prepare() -> tuple[str, str, bytes, str, list[str]]:
        async with Client(redis_url, prefix=prefix, require_worker=False) as client:
            redis, keys = client.redis, client.keys
            jobs = keys.model_stream(MODEL)
            await redis.xgroup_create(jobs.stream, jobs.group, id="0", mkstream=True)
            poison = await client.submit(
                "poison", model=MODEL, max_tokens=MAX_TOKENS, temperature=0.0
            )
            finished = await client.submit(
                "finished", model=MODEL, max_tokens=MAX_TOKENS, temperature=0.0
            )
            reply = await redis.xreadgroup(jobs.group, "ghost", {jobs.stream: ">"}, count=2)
            (entry_id, fields), _ = reply[0][1]
            for _ in range(2):  # each XCLAIM counts one more delivery
                await redis.xclaim(jobs.stream, jobs.group, "ghost", 0, [entry_id])
            rows = await redis.xpending_range(jobs.stream, jobs.group, "-", "+", 10)
            counts = [(r["consumer"], r["times_delivered"]) for r in rows]
            assert counts == [(b"ghost", 3), (b"ghost", 1)]
            # The ghost wrote the finished job's done event, then died before its ack.
            usage = Usage(prompt_tokens=1, completion_tokens=1)
            done = DoneEvent(
                request_id=finished,
                seq=1,
                attempt=1,
                finish_reason="stop",
                output_text="ghost",
                usage=usage,
            )
            await emit(redis, keys, done)
            others = [
                await client.submit(text, max_tokens=MAX_TOKENS, temperature=0.0)
                for text in random_prompts(4, seed=51)
            ]
            return poison, entry_id.decode(), fields[JOB_FIELD.encode()], finished, others

    poison, poison_entry, poison_job, finished, others = run(prepare())
    workers.start("w1", max_deliveries=3, lease_seconds=2)

    async def main() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            poison_events, *other_events = await asyncio.gather(
                collect(client, poison), *(collect(client, rid) for rid in others)
            )
            summary = check_stream(poison_events, poison)
            assert isinstance(summary.terminal, ErrorEvent)
            assert summary.terminal.code == "dead_lettered"
            assert "delivered 4 times" in summary.terminal.message
            assert [type(e) for e in poison_events] == [QueuedEvent, ResetEvent, ErrorEvent]
            assert summary.resets[0].attempt == 4
            for rid, events in zip(others, other_events, strict=True):
                done = check_stream(events, rid).terminal
                assert isinstance(done, DoneEvent)
                assert done.finish_reason == "length"

            await until(lambda: settled(client), 10, "entries acknowledged")
            dead = await _dead_entries(client)
            assert len(dead) == 1
            (entry,) = dead
            assert entry["request_id"] == poison.encode()
            assert entry["entry_id"] == poison_entry.encode()
            assert entry["deliveries"] == b"4"
            assert entry["worker"] == b"w1"
            assert entry["code"] == b"dead_lettered"
            assert entry["message"] == b"delivered 4 times (limit 3)"
            assert entry[JOB_FIELD] == poison_job  # the job as submitted, for a post-mortem

            # The finished job: acknowledged (settled above) without a reset or a rerun.
            events = await collect(client, finished)
            assert [(e.type, e.seq) for e in events] == [("queued", 0), ("done", 1)]
            assert events[-1].output_text == "ghost"
            assert await log_length(client, finished) == 2
            (reply,) = await client.stats()
            assert reply.result["jobs"]["outcomes"] == {
                "already_done": 1,
                "dead_lettered": 1,
                "completed": len(others),
            }

    run(main())


@pytest.mark.timeout(120)
def test_garbage_job_entries_are_dead_lettered_and_the_worker_keeps_serving(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    """Non-msgpack bytes, an entry without a job field, a job with an invalid field but a
    readable request_id and a job the engine refuses: each is dead-lettered with a reason;
    the last two also get an `invalid_job` error event; later jobs still complete. Queued on
    the default stream, each is forwarded (bytes as they are) to the default model's stream
    and dead-lettered there."""
    worker = workers.start("w1")

    async def main() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            redis, keys = client.redis, client.keys
            readable = "garbage-readable-id"
            out_of_vocab = "garbage-out-of-vocab"
            for rid in (readable, out_of_vocab):  # what submit would have written first
                queued = QueuedEvent(request_id=rid, seq=0, attempt=0)
                await publish_events(redis, keys, [queued])
            streams = {
                rid: asyncio.create_task(collect(client, rid)) for rid in (readable, out_of_vocab)
            }
            bad_field = pack(
                {"request_id": readable, "prompt": "hello", "temperature": -1.0}, "job"
            )
            huge_token = encode_job(Job(request_id=out_of_vocab, prompt_token_ids=(10**9,)))
            garbage = b"\xc1\xc1 definitely not msgpack"
            await redis.xadd(keys.jobs, {JOB_FIELD: garbage})
            await redis.xadd(keys.jobs, {"something": b"else"})
            await redis.xadd(keys.jobs, {JOB_FIELD: bad_field})
            await redis.xadd(keys.jobs, {JOB_FIELD: huge_token})
            after = [
                await client.submit(text, max_tokens=MAX_TOKENS, temperature=0.0)
                for text in random_prompts(2, seed=61)
            ]

            for rid in (readable, out_of_vocab):
                summary = check_stream(await asyncio.wait_for(streams[rid], 30), rid)
                assert isinstance(summary.terminal, ErrorEvent)
                assert summary.terminal.code == "invalid_job"
                assert summary.terminal.seq == 1
            readable_error = check_stream(await streams[readable], readable).terminal
            assert "temperature" in readable_error.message
            for rid in after:
                done = check_stream(await collect(client, rid), rid).terminal
                assert isinstance(done, DoneEvent)
                assert done.usage.completion_tokens == MAX_TOKENS

            await until(lambda: settled(client), 10, "entries acknowledged")
            assert await redis.xlen(keys.dead) == 0  # forwarded, not refused on the way
            dead = await _dead_entries(client)
            assert len(dead) == 4, dead
            by_job = {entry[JOB_FIELD]: entry for entry in dead}
            assert set(by_job) == {garbage, b"", bad_field, huge_token}
            assert by_job[garbage]["code"] == b"malformed"
            assert "request_id" not in by_job[garbage]
            assert by_job[b""]["code"] == b"malformed"  # no job field at all
            assert by_job[bad_field]["request_id"] == readable.encode()
            assert by_job[bad_field]["code"] == b"invalid_field"
            assert b"temperature" in by_job[bad_field]["message"]
            assert by_job[huge_token]["request_id"] == out_of_vocab.encode()
            assert by_job[huge_token]["code"] == b"invalid_field"  # a check that needs the model
            for entry in dead:  # the documented fields, and a reason people can read
                assert entry["message"]
                assert entry["deliveries"] == b"1"
                assert entry["worker"] == b"w1"
                assert entry["entry_id"]

    run(main())
    assert worker.running()
