"""Jobs with a ``response_format`` through a real worker (the tiny model) and a real Redis: a
constrained answer that matches, one cut short, and formats the worker refuses up front."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import jsonschema
import pytest

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.codec_job import encode_job
from mlx_redis_protocol.constants import JOB_FIELD
from mlx_redis_protocol.messages import DoneEvent, ErrorEvent, Job
from mlx_redis_worker.bench.hostile_schemas import deep_anyof, schema_bytes
from mlx_redis_worker.daemon.job_prompt import _response_format
from mlx_redis_worker.engine import ResponseFormat
from tests.daemon.helpers import check_stream, collect, settled
from tests.protocol.messages_samples import JOBS
from tests.support.processes import MODEL, WorkerFactory
from tests.support.schemas import SMALL_SCHEMA
from tests.support.waiting import run, until

MAX_TOKENS = 48


async def _dead_entries(client: Client) -> list[dict[str, Any]]:
    """The dead letters of the test model's stream, where every job of these tests runs."""
    entries: Any = await client.redis.xrange(client.keys.model_stream(MODEL).dead, "-", "+")
    return [{key.decode(): value for key, value in fields.items()} for _entry_id, fields in entries]


@pytest.mark.timeout(120)
def test_constrained_jobs_end_valid_or_cut_short_beside_a_plain_one(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    """A chat job and a prompt job with a JSON schema, a regex job, a constrained job cut by
    max_tokens and an unconstrained one, all at once: the matching ones end ``done`` with
    ``output_valid`` true, the cut one with ``length`` and false, the plain one without it."""
    workers.start("w1", max_concurrency=8)
    schema = {"type": "json_schema", "schema": SMALL_SCHEMA}
    fifty = {
        "type": "json_schema",
        "schema": {"type": "array", "items": {"type": "boolean"}, "minItems": 50},
    }
    regex = {"type": "regex", "pattern": r"[a-c]{2,4}-[0-9]{1,2}"}

    async def main() -> dict[str, DoneEvent]:
        async with Client(redis_url, prefix=prefix) as client:
            common: Any = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
            ids = {
                "chat": await client.submit(
                    messages=[{"role": "user", "content": "A color, a digit and a flag?"}],
                    response_format=schema,
                    **common,
                ),
                "prompt": await client.submit("hello", response_format=schema, **common),
                "regex": await client.submit(
                    "a code:", response_format=regex, temperature=1.0, seed=3, max_tokens=24
                ),
                "cut": await client.submit("hello", response_format=fifty, max_tokens=8),
                "plain": await client.submit("hello", max_tokens=8, temperature=0.0),
            }
            streams = await asyncio.gather(*(collect(client, rid) for rid in ids.values()))
            ends = {}
            for (name, rid), events in zip(ids.items(), streams, strict=True):
                terminal = check_stream(events, rid).terminal  # the deltas add up to the text
                assert isinstance(terminal, DoneEvent), (name, terminal)
                ends[name] = terminal
            await until(lambda: settled(client), 10, "entries acknowledged and deleted")
            assert not await _dead_entries(client)
            return ends

    ends = run(main())
    for name in ("chat", "prompt"):
        assert ends[name].finish_reason == "stop", ends[name]
        assert ends[name].output_valid is True
        jsonschema.validate(json.loads(ends[name].output_text), SMALL_SCHEMA)
    assert ends["regex"].finish_reason == "stop" and ends["regex"].output_valid is True
    assert re.fullmatch(regex["pattern"], ends["regex"].output_text), ends["regex"]
    cut = ends["cut"]
    assert cut.finish_reason == "length" and cut.usage.completion_tokens == 8
    assert cut.output_valid is False
    assert cut.output_text.startswith("[")
    assert ends["plain"].output_valid is None


@pytest.mark.timeout(120)
def test_a_format_the_worker_cannot_enforce_is_an_invalid_job_dead_lettered(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    """An unsupported keyword, an unknown format, a Lark grammar that does not compile and
    stop strings with a format: each ends with ``error`` ``invalid_job`` naming the problem,
    its entry (the job as submitted) is dead-lettered, and the worker serves on."""
    worker = workers.start("w1")
    refused: dict[str, dict[str, Any]] = {
        "uniqueItems": {
            "type": "json_schema",
            "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        },
        "Unknown format": {
            "type": "json_schema",
            "schema": {"type": "string", "format": "colour"},
        },
        "undefined_rule": {"type": "grammar", "lark": "start: undefined_rule"},
    }
    jobs = {
        named: Job(request_id=f"refused-{index}", prompt="hello", response_format=fmt)
        for index, (named, fmt) in enumerate(refused.items())
    }
    jobs["stop strings"] = Job(
        request_id="refused-stop",
        prompt="hello",
        stop=("}",),
        response_format={"type": "json_object"},
    )

    async def main() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            for job in jobs.values():
                await client.submit_job(job)
            after = await client.submit(
                "hello",
                max_tokens=MAX_TOKENS,
                response_format={"type": "json_schema", "schema": SMALL_SCHEMA},
            )
            for named, job in jobs.items():
                summary = check_stream(await collect(client, job.request_id), job.request_id)
                error = summary.terminal
                assert isinstance(error, ErrorEvent), (named, error)
                assert error.code == "invalid_job"
                assert named in error.message, error.message
                assert not summary.deltas  # refused before anything ran
            done = check_stream(await collect(client, after), after).terminal
            assert isinstance(done, DoneEvent)
            assert done.output_valid is True
            jsonschema.validate(json.loads(done.output_text), SMALL_SCHEMA)

            await until(lambda: settled(client), 10, "entries acknowledged")
            dead = {entry["request_id"].decode(): entry for entry in await _dead_entries(client)}
            assert set(dead) == {job.request_id for job in jobs.values()}
            for named, job in jobs.items():
                entry = dead[job.request_id]
                assert entry["code"] == b"invalid_field"
                assert named in entry["message"].decode()
                assert entry[JOB_FIELD] == encode_job(job)  # as submitted, for a post-mortem
                assert entry["deliveries"] == b"1" and entry["worker"] == b"w1"
            (reply,) = await client.stats()
            assert reply.result is not None
            outcomes = reply.result["jobs"]["outcomes"]
            assert outcomes == {"completed": 1, "invalid": len(jobs)}

    run(main())
    assert worker.running()


def test_every_wire_response_format_is_an_engine_response_format() -> None:
    """The daemon's join: each type the decoder accepts becomes the engine's form, fields
    unchanged."""
    formats = [job.response_format for job in JOBS if job.response_format is not None]
    formats += [{"type": "json_object"}, {"type": "grammar", "lark": 'start: "a"'}]
    assert {f["type"] for f in formats} == {"json_object", "json_schema", "regex", "grammar"}
    for fmt in formats:
        engine_format = _response_format(Job(request_id="r", prompt="p", response_format=fmt))
        assert isinstance(engine_format, ResponseFormat)
        assert engine_format.type == fmt["type"]
        for name in ("schema", "pattern", "lark"):
            assert getattr(engine_format, name) == fmt.get(name)
    assert _response_format(Job(request_id="r", prompt="p")) is None


@pytest.mark.timeout(120)
def test_a_format_over_a_grammar_limit_is_an_invalid_job_naming_it(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    """A worker run with MLXW_MAX_SCHEMA_BYTES refuses a larger schema as ``invalid_job``
    naming the limit, before anything runs, and serves a small one beside it."""
    workers.start("w1", env={"MLXW_MAX_SCHEMA_BYTES": "4096"})
    large = {"type": "json_schema", "schema": deep_anyof("job", width=4, depth=2)}
    assert schema_bytes(large["schema"]) > 4096 > schema_bytes(SMALL_SCHEMA)

    async def main() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            refused = await client.submit("hello", response_format=large, max_tokens=MAX_TOKENS)
            small = {"type": "json_schema", "schema": SMALL_SCHEMA}
            served = await client.submit("hello", response_format=small, max_tokens=MAX_TOKENS)
            summary = check_stream(await collect(client, refused), refused)
            error = summary.terminal
            assert isinstance(error, ErrorEvent)
            assert error.code == "invalid_job"
            assert "over max_schema_bytes (4096)" in error.message, error.message
            assert not summary.deltas
            done = check_stream(await collect(client, served), served).terminal
            assert isinstance(done, DoneEvent) and done.output_valid is True
            await until(lambda: settled(client), 10, "entries acknowledged")
            dead = await _dead_entries(client)
            assert [entry["request_id"].decode() for entry in dead] == [refused]

    run(main())
