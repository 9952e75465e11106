"""The blocking wrapper, against a stand-in worker on another thread."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from mlx_redis_protocol.codec_job import decode_job
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import DeltaEvent, DoneEvent, QueuedEvent
from mlx_redis_protocol.sync_client import SyncClient
from tests.protocol.background import Background
from tests.protocol.fake_responder import FakeResponder
from tests.protocol.helpers import emit, text_events, wait_for_job


def stand_in(redis_url: str, keys: Keys) -> Background:
    """Answers control commands and runs the first job it finds."""

    async def main(stop: asyncio.Event) -> None:
        redis = Redis.from_url(redis_url)
        try:
            async with FakeResponder(redis, keys, "w-1"):
                job = decode_job(await wait_for_job(redis, keys))
                await emit(redis, keys, *text_events(job.request_id, ["a", "b"]))
                await stop.wait()
        finally:
            await redis.aclose()

    return Background(main)


def test_generate_stream_and_control(redis_url: str, keys: Keys) -> None:
    with stand_in(redis_url, keys), SyncClient(redis_url, prefix=keys.prefix) as client:
        result = client.generate("hi", max_tokens=5, request_id="sync-1", timeout=5)
        assert isinstance(result, DoneEvent) and result.output_text == "ab"
        events = list(client.stream("sync-1", timeout=5))
        assert [type(event) for event in events] == [
            QueuedEvent,
            DeltaEvent,
            DeltaEvent,
            DoneEvent,
        ]
        assert [reply.worker_id for reply in client.ping(timeout=5)] == ["w-1"]
        assert client.stats(timeout=5)[0].ok


def test_leaving_a_stream_early_and_closing_twice(redis_url: str, keys: Keys) -> None:
    client = SyncClient(redis_url, prefix=keys.prefix)
    request_id = client.submit(prompt_token_ids=[1, 2, 3])
    for event in client.stream(request_id):
        assert isinstance(event, QueuedEvent)
        break
    client.close()
    client.close()
