"""Image and video jobs through the queue to a real worker serving the tiny vision-language
model (``tiny-vision``), on a real Redis: the images reach the model, big files go by blob,
videos by file and by frames, every hostile file ends its job ``invalid_job`` and the worker
keeps serving; and the same through the gateway, sent by the openai SDK."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent, ErrorEvent, ImageInput, TerminalEvent
from mlx_redis_worker.bench.hostile_images import data_url
from mlx_redis_worker.local_redis import RedisServer
from tests.support.gateway import GatewayFactory, GatewayProcess
from tests.support.media import image_file, png_bomb, video_file
from tests.support.processes import WorkerFactory
from tests.support.waiting import run

VISION = "tiny-vision"
# Small limits for the hostile cases (the worker's settings): a 200x200 picture passes.
LIMITS = {"MLXW_MAX_IMAGE_PIXELS": str(400 * 400), "MLXW_MAX_IMAGE_BYTES": str(512 * 1024)}
GREEDY: Any = {"max_tokens": 6, "temperature": 0.0, "model": VISION}


@pytest.fixture(scope="module")
def vision_fleet(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerFactory, GatewayProcess]]:
    """One tiny-vision worker and one gateway for the module."""
    directory = tmp_path_factory.mktemp("vision")
    prefix = f"v{directory.name[-8:]}"
    workers = WorkerFactory(directory, redis_server.url, prefix)
    gateways = GatewayFactory(directory, redis_server.url, prefix)
    try:
        workers.start("vision-1", model=VISION, max_concurrency=4, env=LIMITS)
        yield workers, gateways.start()
    finally:
        gateways.stop_all()
        workers.kill_all()
        print(workers.report(), gateways.report())


def _ask(redis_url: str, prefix: str, jobs: list[dict[str, Any]]) -> list[TerminalEvent]:
    async def main() -> list[TerminalEvent]:
        async with Client(redis_url, prefix=prefix, inline_media_bytes=16 * 1024) as client:
            ids = [
                await client.submit(
                    messages=[{"role": "user", "content": "What is in the picture?"}],
                    **GREEDY,
                    **job,
                )
                for job in jobs
            ]
            return list(await asyncio.gather(*(client.wait(rid, timeout=120) for rid in ids)))

    return run(main())


@pytest.mark.timeout(300)
def test_images_and_videos_reach_the_model_through_the_queue(
    vision_fleet: tuple[WorkerFactory, GatewayProcess],
) -> None:
    workers, _ = vision_fleet
    big = image_file(9, (200, 200))  # over the client's inline threshold here: a blob
    ends = _ask(
        workers.redis_url,
        workers.prefix,
        [
            {"images": [image_file(1, (64, 64))]},
            {"images": [image_file(2, (64, 64))]},
            {"images": [image_file(1, (64, 64))]},
            {"images": [big]},
            {"videos": [video_file(20, 10)]},
            {"videos": [[image_file(3), image_file(4)]]},
            {"images": [image_file(1, (64, 64))], "videos": [video_file(20, 10)]},
        ],
    )
    assert all(isinstance(end, DoneEvent) for end in ends), ends
    texts = [end.output_text for end in ends if isinstance(end, DoneEvent)]
    assert texts[0] == texts[2]  # the same picture, greedy: the same words
    assert texts[0] != texts[1]  # another picture: the image reaches the model
    # A 2 s video at 1 frame a second, and a list of 2 frames: two pictures' tokens each.
    tokens = [end.usage.prompt_tokens for end in ends if isinstance(end, DoneEvent)]
    assert tokens[4] > tokens[0] and tokens[5] > tokens[0], tokens
    assert tokens[6] > tokens[4], tokens  # an image and a video in one chat: both placed


@pytest.mark.timeout(300)
def test_hostile_files_end_their_jobs_and_the_worker_keeps_serving(
    vision_fleet: tuple[WorkerFactory, GatewayProcess],
) -> None:
    workers, _ = vision_fleet
    png = image_file(5, (64, 64))
    hostile: list[tuple[dict[str, Any], str]] = [
        (
            {"images": [png_bomb()]},
            "limit_exceeded: job.images[0] is 65535x65535 pixels, over max_image_pixels",
        ),
        ({"images": [png_bomb(500, 500)]}, "500x500 pixels, over max_image_pixels"),
        ({"images": [png[: len(png) // 2]]}, "corrupt or truncated"),
        ({"images": [ImageInput(blob="never-stored")]}, "no such blob"),
        ({"images": [ImageInput(url="https://example.com/a.png")]}, "fetches no URLs"),
        ({"videos": [video_file(20, 10)[:500]]}, "invalid_field: job.videos[0]"),
        # A count would leave out the image's tokens (the vision processor's to make).
        ({"images": [png], "count_only": True}, "job.count_only cannot count images"),
    ]
    ends = _ask(workers.redis_url, workers.prefix, [job for job, _ in hostile])
    for end, (_, message) in zip(ends, hostile, strict=True):
        assert isinstance(end, ErrorEvent) and end.code == "invalid_job", end
        assert message in end.message, end.message
    (after,) = _ask(workers.redis_url, workers.prefix, [{"images": [png]}])
    assert isinstance(after, DoneEvent)


@pytest.mark.timeout(300)
def test_the_openai_sdk_sends_png_and_jpeg_files(
    vision_fleet: tuple[WorkerFactory, GatewayProcess], tmp_path: Path
) -> None:
    _, gateway = vision_fleet
    client = openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0)
    (tmp_path / "page.jpg").write_bytes(image_file(6, (120, 90), "JPEG"))
    jpeg = (tmp_path / "page.jpg").read_bytes()
    answer = client.chat.completions.create(
        model=VISION,
        max_tokens=6,
        temperature=0,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare"},
                    {"type": "image_url", "image_url": {"url": data_url(image_file(7))}},
                    {"type": "image_url", "image_url": {"url": data_url(jpeg, "jpeg")}},
                ],
            }
        ],
    )
    assert answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.prompt_tokens > 20  # image tokens
    with pytest.raises(openai.BadRequestError, match="65535x65535 pixels"):
        client.chat.completions.create(
            model=VISION,
            max_tokens=6,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": data_url(png_bomb())}}],
                }
            ],
        )
    models = {m.id: m.model_dump() for m in client.models.list()}
    assert models[VISION]["input_modalities"] == ["text", "image", "video"]
