"""The client's side of models: a job naming a model goes to that model's stream when a live
worker serves it, and otherwise ends at once with an `unknown_model` error event (nothing is
queued); control commands naming a model wait only for that model's workers. Against a real
redis-server, with hand-written heartbeats and stand-in responders."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis

from mlx_redis_protocol import client as client_module
from mlx_redis_protocol.cli import main
from mlx_redis_protocol.client import Client
from mlx_redis_protocol.codec_control import decode_command, encode_reply
from mlx_redis_protocol.codec_job import decode_job
from mlx_redis_protocol.connection import RedisClient
from mlx_redis_protocol.constants import JOB_FIELD
from mlx_redis_protocol.errors import ControlTimeout, ProtocolError
from mlx_redis_protocol.heartbeat import Heartbeat, ServedModel
from mlx_redis_protocol.keys import JobStream, Keys
from mlx_redis_protocol.messages import ControlCommand, ControlReply, ErrorEvent, QueuedEvent
from mlx_redis_protocol.sync_client import SyncClient
from tests.protocol.background import Background
from tests.support.fleet import write_heartbeat
from tests.support.waiting import run


def heartbeat(worker_id: str, *models: str) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id,
        pid=1,
        started_at=1.0,
        in_flight=0,
        default_model=models[0] if models else None,
        models={m: ServedModel(max_concurrency=2, free_slots=2, in_flight=0) for m in models},
    )


async def serve(redis: RedisClient, keys: Keys, worker_id: str, *models: str) -> None:
    await write_heartbeat(redis, keys, worker_id, heartbeat(worker_id, *models).encode(), models)


async def job_entries(redis: RedisClient, stream: JobStream) -> list[bytes]:
    entries = await redis.xrange(stream.stream)
    return [fields[JOB_FIELD.encode()] for _id, fields in entries]


def test_an_unknown_model_ends_the_request_and_queues_nothing(redis_url: str, keys: Keys) -> None:
    async def main() -> None:
        async with Client(redis_url, prefix=keys.prefix) as client:
            await serve(client.redis, keys, "w1", "b", "a")
            request_id = await client.submit("hi", model="nope", metadata={"tag": 7})
            events = []
            started = time.monotonic()
            async for event in client.stream(request_id, timeout=5):
                events.append(event)
            assert time.monotonic() - started < 1.0
            assert events[0] == QueuedEvent(request_id=request_id, seq=0, attempt=0)
            (error,) = events[1:]
            assert isinstance(error, ErrorEvent)
            assert (error.code, error.seq, error.attempt) == ("unknown_model", 1, 0)
            assert error.message == "no live worker serves model 'nope' (served: a, b)"
            assert error.metadata == {"tag": 7}
            for stream in (keys.default_stream, keys.model_stream("nope")):
                assert not await client.redis.exists(stream.stream)
            # generate and wait see the same end.
            ended = await client.generate("hi", model="nope", timeout=5)
            assert isinstance(ended, ErrorEvent) and ended.code == "unknown_model"

    run(main())


def test_with_no_worker_at_all_the_message_says_none_is_served(redis_url: str, keys: Keys) -> None:
    async def main() -> None:
        async with Client(redis_url, prefix=keys.prefix) as client:
            ended = await client.generate("hi", model="m", timeout=5)
            assert isinstance(ended, ErrorEvent)
            assert ended.message == "no live worker serves model 'm' (served: none)"

    run(main())


def test_a_served_model_queues_on_its_stream(redis_url: str, keys: Keys) -> None:
    async def main() -> None:
        async with Client(redis_url, prefix=keys.prefix) as client:
            await serve(client.redis, keys, "w1", "a")
            request_id = await client.submit("hi", model="a", max_tokens=3)
            (data,) = await job_entries(client.redis, keys.model_stream("a"))
            job = decode_job(data)
            assert (job.request_id, job.model, job.max_tokens) == (request_id, "a", 3)
            assert not await client.redis.exists(keys.jobs)
            # Its log holds the queued marker only: the worker's events come next.
            assert await client.redis.xlen(keys.log(request_id)) == 1

    run(main())


def test_a_job_naming_no_model_goes_to_the_default_stream_unchecked(
    redis_url: str, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_catalogue(*_: object) -> dict[str, frozenset[str]]:
        raise AssertionError("a job naming no model must not read the catalogue")

    monkeypatch.setattr(client_module, "served_media", no_catalogue)

    async def main() -> None:
        async with Client(redis_url, prefix=keys.prefix) as client:
            request_id = await client.submit("hi")
            (data,) = await job_entries(client.redis, keys.default_stream)
            assert decode_job(data).request_id == request_id
            assert decode_job(data).model is None

    run(main())


def test_a_positive_answer_is_reused_briefly_and_a_miss_is_read_again(
    redis_url: str, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[float] = []
    real = client_module.served_media

    async def counted(redis: RedisClient, keys: Keys) -> dict[str, frozenset[str]]:
        reads.append(time.monotonic())
        return await real(redis, keys)

    monkeypatch.setattr(client_module, "served_media", counted)

    async def main() -> None:
        async with Client(redis_url, prefix=keys.prefix) as client:
            await serve(client.redis, keys, "w1", "a")
            for _ in range(6):  # a burst: one catalogue read
                await client.submit("hi", model="a")
            assert len(reads) == 1
            # The worker stops: within the cache's life, jobs still go to its stream.
            await client.redis.delete(keys.worker("w1"))
            await client.submit("hi", model="a")
            assert len(reads) == 1
            assert len(await job_entries(client.redis, keys.model_stream("a"))) == 7
            # A model not in the cached answer is always looked up.
            for _ in range(2):
                ended = await client.generate("hi", model="b", timeout=5)
                assert isinstance(ended, ErrorEvent)
            assert len(reads) == 3
            # Past the cache's life, the catalogue is read again: `a` is gone now.
            monkeypatch.setattr(client_module, "MODEL_CACHE_SECONDS", 0.0)
            ended = await client.generate("hi", model="a", timeout=5)
            assert isinstance(ended, ErrorEvent) and ended.code == "unknown_model"
            assert len(reads) == 4

    run(main())


def test_concurrent_submits_after_an_idle_spell_share_one_catalogue_read(
    redis_url: str, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = 0
    real = client_module.served_media

    async def counted(redis: RedisClient, keys: Keys) -> dict[str, frozenset[str]]:
        nonlocal reads
        reads += 1
        await asyncio.sleep(0.05)  # a read that takes a while, as a SCAN of many keys does
        return await real(redis, keys)

    monkeypatch.setattr(client_module, "served_media", counted)

    async def main() -> None:
        async with Client(redis_url, prefix=keys.prefix) as client:
            await serve(client.redis, keys, "w1", "a")
            await asyncio.gather(*(client.submit("hi", model="a") for _ in range(32)))
            assert reads == 1
            assert len(await job_entries(client.redis, keys.model_stream("a"))) == 32
            await client.served_models()  # the shared read is over: the next one is new
            assert reads == 2

    run(main())


def test_an_invalid_model_is_refused_before_redis(redis_url: str, keys: Keys) -> None:
    async def main() -> None:
        async with Client(redis_url, prefix=keys.prefix) as client:
            with pytest.raises(ProtocolError) as raised:
                await client.submit("hi", model="a b")
            assert raised.value.code == "invalid_field"
            with pytest.raises(ProtocolError):
                await client.stats(model="a b")

    run(main())


def test_the_sync_client_takes_a_model(redis_url: str, keys: Keys) -> None:
    with SyncClient(redis_url, prefix=keys.prefix) as client:
        ended = client.generate("hi", model="nope", timeout=5)
        assert isinstance(ended, ErrorEvent) and ended.code == "unknown_model"
        assert client.served_models() == frozenset()


class ModelResponder:
    """A stand-in worker serving ``models``: a heartbeat advertising them, and answers to
    control commands that name none of them only when they name no model at all."""

    def __init__(self, redis: Redis, keys: Keys, worker_id: str, *models: str) -> None:
        self.redis, self.keys, self.worker_id, self.models = redis, keys, worker_id, models
        self.received: list[ControlCommand] = []

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(self.keys.control, self.keys.control_for(self.worker_id))
        for _ in range(2):
            await pubsub.get_message(timeout=5)
        await serve(self.redis, self.keys, self.worker_id, *self.models)
        stop = asyncio.Event()
        task = asyncio.create_task(self._serve(pubsub, stop))
        try:
            yield
        finally:
            stop.set()
            await task
            await pubsub.aclose()  # type: ignore[no-untyped-call]
            await self.redis.delete(self.keys.worker(self.worker_id))

    async def _serve(self, pubsub: object, stop: asyncio.Event) -> None:
        while not stop.is_set():
            message = await pubsub.get_message(  # type: ignore[attr-defined]
                ignore_subscribe_messages=True, timeout=0.05
            )
            if message is None:
                continue
            command = decode_command(message["data"])
            self.received.append(command)
            if command.model is not None and command.model not in self.models:
                continue  # another model's command: not acted on, not answered
            reply = ControlReply(
                id=command.id,
                ok=True,
                worker_id=self.worker_id,
                result={"pong": True, "time": 1.0} if command.kind == "ping" else {},
            )
            await self.redis.rpush(command.reply_to, encode_reply(reply))
            await self.redis.expire(command.reply_to, 60)


@contextlib.asynccontextmanager
async def fleet(redis_url: str, keys: Keys) -> AsyncIterator[list[ModelResponder]]:
    """w1 serves a and b, w2 serves a, w3 serves c."""
    connections = [Redis.from_url(redis_url) for _ in range(3)]
    responders = [
        ModelResponder(connections[0], keys, "w1", "a", "b"),
        ModelResponder(connections[1], keys, "w2", "a"),
        ModelResponder(connections[2], keys, "w3", "c"),
    ]
    try:
        async with contextlib.AsyncExitStack() as stack:
            for responder in responders:
                await stack.enter_async_context(responder.running())
            yield responders
    finally:
        for connection in connections:
            await connection.aclose()


def test_control_with_a_model_waits_for_that_models_workers_only(
    redis_url: str, keys: Keys
) -> None:
    """With a 10 s timeout, each call returns as soon as the expected replies are in: their
    count is the live heartbeats serving the model, not every heartbeat."""

    async def main() -> None:
        async with (
            fleet(redis_url, keys) as responders,
            Client(redis_url, prefix=keys.prefix) as client,
        ):
            started = time.monotonic()
            replies = await client.ping(model="a", timeout=10)
            assert sorted(r.worker_id for r in replies) == ["w1", "w2"]
            replies = await client.stats(model="c", timeout=10)
            assert [r.worker_id for r in replies] == ["w3"]
            replies = await client.cache_clear(model="b", timeout=10)
            assert [r.worker_id for r in replies] == ["w1"]
            replies = await client.ping(timeout=10)
            assert sorted(r.worker_id for r in replies) == ["w1", "w2", "w3"]
            replies = await client.cache_save("x", model="a", timeout=10)
            assert sorted(r.worker_id for r in replies) == ["w1", "w2"]
            assert time.monotonic() - started < 5
            # Every worker heard every broadcast; the command carried the model.
            assert [c.model for c in responders[2].received] == ["a", "c", "b", None, "a"]
            # Nobody serves `z`: no wait at all.
            started = time.monotonic()
            with pytest.raises(ControlTimeout, match="no live worker serves model 'z'"):
                await client.ping(model="z", timeout=10)
            assert await client.abort("r1", model="z", timeout=10) == []
            assert time.monotonic() - started < 2

    run(main())


@contextlib.contextmanager
def background_fleet(redis_url: str, keys: Keys) -> Iterator[None]:
    ready = threading.Event()

    async def main(stop: asyncio.Event) -> None:
        async with fleet(redis_url, keys):
            ready.set()
            await stop.wait()

    with Background(main):
        assert ready.wait(10), "the responders did not start"
        yield


def test_ctl_model_flag(redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]) -> None:
    with background_fleet(redis_url, keys):
        code = main(
            ["ctl", "ping", "--redis-url", redis_url, "--prefix", keys.prefix, "--model", "a"]
        )
        assert code == 0
        assert capsys.readouterr().out.splitlines() == ["w1: pong", "w2: pong"]
        code = main(
            ["ctl", "ping", "--redis-url", redis_url, "--prefix", keys.prefix, "--model", "z"]
        )
        assert code == 5
        assert "no live worker serves model 'z'" in capsys.readouterr().err


def submit_cli(redis_url: str, keys: Keys, *args: str) -> int:
    return main(["submit", "hi", "--redis-url", redis_url, "--prefix", keys.prefix, *args])


def test_submit_model_flag_unknown_exits_1_with_the_error(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    assert submit_cli(redis_url, keys, "--model", "nope", "--timeout", "5") == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "error (unknown_model): no live worker serves model 'nope' (served: none)"
    ]
    assert submit_cli(redis_url, keys, "--model", "nope", "--no-stream", "--request-id", "r9") == 1
    captured = capsys.readouterr()
    assert captured.out == "r9\n"
    assert "error (unknown_model)" in captured.err


def test_submit_model_flag_queues_on_the_models_stream(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    async def prepare() -> None:
        redis = Redis.from_url(redis_url)
        try:
            await serve(redis, keys, "w1", "a")
        finally:
            await redis.aclose()

    async def queued() -> list[bytes]:
        redis = Redis.from_url(redis_url)
        try:
            return await job_entries(redis, keys.model_stream("a"))
        finally:
            await redis.aclose()

    run(prepare())
    args = ("--model", "a", "--no-stream", "--request-id", "r1", "--max-tokens", "4")
    assert submit_cli(redis_url, keys, *args) == 0
    assert capsys.readouterr().out == "r1\n"
    (data,) = run(queued())
    job = decode_job(data)
    assert (job.request_id, job.model, job.max_tokens) == ("r1", "a", 4)
