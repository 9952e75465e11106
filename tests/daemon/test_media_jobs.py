"""Jobs with images and videos through a real worker and a real Redis, on a text-only model:
the client stores big files in blobs, the heartbeat says the model takes no media, the
client refuses such a job at submit time, and a worker refuses one that reaches it (typed,
dead-lettered) and keeps serving."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent, ErrorEvent
from tests.daemon.helpers import collect
from tests.support.media import image_file, video_file
from tests.support.processes import MODEL, WorkerFactory
from tests.support.waiting import run, until


@pytest.mark.timeout(120)
def test_a_text_only_model_refuses_media_jobs_and_keeps_serving(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    workers.start("w1")
    small, big = image_file(1), image_file(2, (600, 600))  # big: over the inline threshold

    async def main() -> None:
        async with Client(redis_url, prefix=prefix, inline_media_bytes=4096) as client:
            beat: Any = json.loads(await client.redis.get(client.keys.worker("w1")))
            assert beat["models"][MODEL]["media"] == []  # text only, as the heartbeat says
            # Named model: refused at submit time, nothing queued, no worker involved.
            refused = await client.generate("Describe", model=MODEL, images=[small], timeout=10)
            assert isinstance(refused, ErrorEvent) and refused.code == "invalid_job"
            assert refused.attempt == 0
            assert f"model {MODEL!r} does not take images" in refused.message
            # No model named (the default stream): the worker refuses it, typed.
            rid = await client.submit("Describe", images=[small, big], videos=[video_file(4)])
            events = await collect(client, rid)
            end = events[-1]
            assert isinstance(end, ErrorEvent) and end.code == "invalid_job", end
            assert f"model {MODEL!r} does not take images or videos" in end.message
            # The big file went to a blob with a TTL; the entry carried its id, not its bytes.
            dead_stream = client.keys.model_stream(MODEL).dead
            await until(lambda: client.redis.xlen(dead_stream), 10, "the job dead-lettered")
            ((_, fields),) = await client.redis.xrange(dead_stream)
            assert len(fields[b"job"]) < 4096 + len(small) + 1024
            assert fields[b"code"] == b"invalid_field"
            (blob_key,) = [key async for key in client.redis.scan_iter(f"{prefix}:blob:*")]
            assert await client.redis.get(blob_key) == big
            assert 0 < await client.redis.ttl(blob_key) <= client.blob_ttl
            # The worker keeps serving text.
            done = await client.generate("hello", max_tokens=4, timeout=30)
            assert isinstance(done, DoneEvent)

    run(main())
