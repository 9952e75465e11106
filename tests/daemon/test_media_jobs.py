"""Jobs with images and videos through a real worker and a real Redis, on a text-only model:
the client stores big files in blobs, the heartbeat says the model takes no media, the
client refuses such a job at submit time, and a worker refuses one that reaches it (typed,
dead-lettered) and keeps serving."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent, ErrorEvent
from tests.daemon.helpers import collect
from tests.support.media import image_file, video_file
from tests.support.processes import MODEL, WorkerFactory, mlx_worker
from tests.support.waiting import run, until


@pytest.mark.timeout(120)
def test_a_text_only_model_refuses_media_jobs_and_keeps_serving(
    workers: WorkerFactory, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    workers.start("w1")
    # The command line: files by path, refused at submit for the text-only model (exit 1),
    # and a file that is no image refused before Redis is asked anything (exit 2).
    (tmp_path / "a.png").write_bytes(image_file(3))
    (tmp_path / "c.mp4").write_bytes(video_file(4))
    (tmp_path / "doc.pdf").write_bytes(b"%PDF-1.7 a document")
    where = ["--redis-url", redis_url, "--prefix", prefix, "--timeout", "30"]
    images = ["--image", str(tmp_path / "a.png"), "--video", str(tmp_path / "c.mp4")]
    refused = mlx_worker("submit", "Describe", "--model", MODEL, *images, *where)
    assert refused.returncode == 1, refused.stderr
    assert "invalid_job" in refused.stderr and "does not take images or videos" in refused.stderr
    bad = mlx_worker("submit", "Describe", "--image", str(tmp_path / "doc.pdf"), *where)
    assert bad.returncode == 2 and "not of an allowed format" in bad.stderr, bad.stderr
    small, big = image_file(1), image_file(2, (600, 600))  # big: over the inline threshold

    async def main() -> None:
        async with Client(redis_url, prefix=prefix, inline_media_bytes=4096) as client:
            beat: Any = json.loads(await client.redis.get(client.keys.worker("w1")))
            assert beat["models"][MODEL]["media"] == []  # text only, as the heartbeat says
            # Named model: refused at submit time, nothing queued or stored, no worker involved.
            refused = await client.generate("Describe", model=MODEL, images=[big], timeout=10)
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
            # Nothing was decoded for the text-only model: no pool work, nothing refused there.
            (reply,) = await client.stats()
            assert reply.result is not None
            media = reply.result["models"][MODEL]["media"]
            assert media["pool"]["done"] == 0 and media["images"] == 0

    run(main())
