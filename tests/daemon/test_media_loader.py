"""A job's media from source to decoded frames (``MediaLoader`` on a real Redis, the real
decoders in the real pool): each hostile input ends in its typed error, before any decoding
where the issue says so, and the loader keeps serving the next job."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.limits import DEFAULT_LIMITS, Limits
from mlx_redis_protocol.media_fetch import FetchPolicy
from mlx_redis_protocol.messages import ImageInput, Job, VideoInput
from mlx_redis_worker.daemon.media_loader import LoadedMedia, MediaLoader
from mlx_redis_worker.daemon.media_pool import MediaPool
from mlx_redis_worker.media.errors import MediaError
from mlx_redis_worker.thread_priority import LOWEST_NICENESS
from tests.support.media import image_file, png_bomb, serving_media, video_file
from tests.support.waiting import run

PNG = image_file(1, (40, 30))


def _job(images: tuple[ImageInput, ...] = (), videos: tuple[VideoInput, ...] = ()) -> Job:
    return Job(request_id="r", prompt="hi", images=images or None, videos=videos or None)


async def _load(
    redis_url: str,
    prefix: str,
    job: Job,
    *,
    blobs: dict[str, Any] | None = None,
    limits: Limits = DEFAULT_LIMITS,
    fetch: FetchPolicy | None = None,
) -> LoadedMedia:
    """Load ``job``'s media (its blobs stored first: bytes as strings, a list as a list), then
    a good image job on the same loader: it must still serve."""
    pool = MediaPool(2)
    async with Client(redis_url, prefix=prefix) as client:
        for name, value in (blobs or {}).items():
            key = client.keys.blob(name)
            if isinstance(value, list):
                await client.redis.rpush(key, *value)
            else:
                await client.redis.set(key, value)
        loader = MediaLoader(
            redis=client.redis,
            keys=client.keys,
            limits=limits,
            pool=pool,
            fetch=fetch or FetchPolicy(),
        )
        try:
            return await loader.load(job)
        finally:
            after = await loader.load(_job((ImageInput(data=PNG),)))
            assert after.images[0].size == (40, 30)
            pool.close()


def _refused(redis_url: str, prefix: str, job: Job, code: str, match: str, **kw: Any) -> None:
    with pytest.raises(MediaError, match=match) as caught:
        run(_load(redis_url, prefix, job, **kw))
    assert caught.value.code == code


def test_images_and_videos_load_from_inline_bytes_and_blobs(redis_url: str, prefix: str) -> None:
    job = _job(
        (ImageInput(data=PNG), ImageInput(blob="big", detail="low")),
        (VideoInput(blob="clip", fps=2.0), VideoInput(frames=(ImageInput(data=PNG),) * 2)),
    )
    big = image_file(2, (1200, 900), "JPEG")
    loaded = run(_load(redis_url, prefix, job, blobs={"big": big, "clip": video_file(30, 10)}))
    assert [image.size for image in loaded.images] == [(40, 30), (512, 384)]
    assert [len(frames) for frames in loaded.videos] == [6, 2]  # 3 s at 2 fps; the list
    grey = [frame.getpixel((0, 0))[0] for frame in loaded.videos[0]]
    assert grey == sorted(grey) and grey[0] < 8 < grey[1]  # frames in order, 0.5 s apart


def test_a_decompression_bomb_is_refused_from_its_header(redis_url: str, prefix: str) -> None:
    """65,535 x 65,535 pixels over a few KB: refused before ``load`` (no 12 GB allocation)."""
    bomb = png_bomb()
    assert len(bomb) < 4096
    _refused(
        redis_url, prefix, _job((ImageInput(data=bomb),)), "limit_exceeded", "max_image_pixels"
    )
    # Under Pillow's own bomb bound but over ours: our check, naming the size.
    _refused(
        redis_url,
        prefix,
        _job((ImageInput(data=png_bomb(8000, 5000)),)),
        "limit_exceeded",
        "8000x5000 pixels",
    )


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (PNG[: len(PNG) // 2], "corrupt or truncated"),
        (image_file(3, (64, 64), "JPEG")[:300], "truncated|Truncated"),
        # 16 x 16 pixels stated, then garbage (all 0xff would state 65,535 x 65,535: a bomb).
        (b"GIF89a\x10\x00\x10\x00" + b"\xff" * 36, "not a readable gif"),
        (b"\x89PNG\r\n\x1a\n" + b"garbage" * 10, "not a readable png"),
    ],
)
def test_corrupt_and_truncated_images_are_refused(
    redis_url: str, prefix: str, data: bytes, match: str
) -> None:
    _refused(redis_url, prefix, _job((ImageInput(data=data),)), "invalid_field", match)


def test_blobs_that_are_missing_of_another_type_or_too_big(redis_url: str, prefix: str) -> None:
    small = replace(DEFAULT_LIMITS, max_image_bytes=len(PNG) - 1)
    cases: list[tuple[dict[str, Any], Limits, str, str]] = [
        ({}, DEFAULT_LIMITS, "invalid_field", "no such blob"),
        ({"b": [b"a list"]}, DEFAULT_LIMITS, "invalid_field", "not a string key"),
        ({"b": PNG}, small, "limit_exceeded", f"{len(PNG)} bytes, over {len(PNG) - 1}"),
        ({"b": b"%PDF-1.4 a document"}, DEFAULT_LIMITS, "invalid_field", "allowed format"),
    ]
    for blobs, limits, code, match in cases:
        job = _job((ImageInput(blob="b"),))
        _refused(
            redis_url, f"{prefix}{len(blobs)}{code}", job, code, match, blobs=blobs, limits=limits
        )


def test_the_job_total_counts_blobs_before_any_is_read(redis_url: str, prefix: str) -> None:
    limits = replace(DEFAULT_LIMITS, max_media_bytes=2 * len(PNG) - 1)
    job = _job((ImageInput(blob="a"), ImageInput(data=PNG)))
    _refused(
        redis_url, prefix, job, "limit_exceeded", "max_media_bytes", blobs={"a": PNG}, limits=limits
    )


def test_hostile_videos(redis_url: str, prefix: str) -> None:
    clip = video_file(30, 10)  # 3 s
    short = replace(DEFAULT_LIMITS, max_video_seconds=2)
    cases: list[tuple[bytes, Limits, str, str]] = [
        (clip, short, "limit_exceeded", "max_video_seconds"),
        (clip[: len(clip) // 3], DEFAULT_LIMITS, "invalid_field", "mp4"),
        (b"\x1a\x45\xdf\xa3" + b"\0" * 64, DEFAULT_LIMITS, "invalid_field", "webm"),
        (
            video_file(2, 10, (64, 48)),
            replace(DEFAULT_LIMITS, max_image_pixels=64 * 47),
            "limit_exceeded",
            "64x48",
        ),
    ]
    for data, limits, code, match in cases:
        _refused(
            redis_url, prefix, _job(videos=(VideoInput(data=data),)), code, match, limits=limits
        )
    # More frames than asked for are spread over the video, never more than max_frames.
    loaded = run(
        _load(redis_url, prefix, _job(videos=(VideoInput(data=clip, fps=10, max_frames=4),)))
    )
    assert len(loaded.videos[0]) == 4


@pytest.fixture
def media_server() -> Iterator[str]:
    with serving_media({"/a.png": PNG, "/big": b"x" * 100_000}) as url:
        yield url


def test_urls_only_from_allowed_hosts_and_never_private_ones(
    redis_url: str, prefix: str, media_server: str
) -> None:
    def job(path: str) -> Job:
        return _job((ImageInput(url=f"{media_server}{path}"),))

    allowed = FetchPolicy.of(["localhost"])
    loopback = FetchPolicy.of(["localhost"], networks=["127.0.0.0/8"])
    small = replace(DEFAULT_LIMITS, max_image_bytes=50_000)
    _refused(redis_url, prefix, job("/a.png"), "invalid_field", "fetches no URLs")
    _refused(
        redis_url,
        prefix,
        job("/a.png"),
        "invalid_field",
        "does not allow",
        fetch=FetchPolicy.of(["media.example.com"]),
    )
    # Allowed by name, but it resolves to loopback: refused after resolution.
    _refused(
        redis_url, prefix, job("/a.png"), "invalid_field", "not a public address", fetch=allowed
    )
    # The operator allows loopback explicitly: fetched; a redirect is never followed; an
    # answer over the image limit is cut at it.
    loaded = run(_load(redis_url, prefix, job("/a.png"), fetch=loopback))
    assert loaded.images[0].size == (40, 30)
    _refused(
        redis_url,
        prefix,
        job("/moved"),
        "invalid_field",
        "redirects are not followed",
        fetch=loopback,
    )
    _refused(
        redis_url,
        prefix,
        job("/big"),
        "limit_exceeded",
        "100000 bytes",
        fetch=loopback,
        limits=small,
    )


def test_tenants_take_turns_in_the_pool() -> None:
    """One thread, a tenant with 6 pieces queued, then another with one: the second runs
    second, not seventh."""

    async def main() -> list[str]:
        pool = MediaPool(1)
        order: list[str] = []
        gate = threading.Event()

        def work(name: str) -> str:
            gate.wait(10)
            order.append(name)
            return name

        flood = [asyncio.ensure_future(pool.run("a", lambda i=i: work(f"a{i}"))) for i in range(6)]
        await asyncio.sleep(0)
        lone = asyncio.ensure_future(pool.run("b", lambda: work("b0")))
        await asyncio.sleep(0)
        assert pool.stats.waiting == 6  # a1..a5 and b0 wait; a0 runs
        gate.set()
        await asyncio.gather(*flood, lone)
        pool.close()
        return order

    assert run(main())[:3] == ["a0", "a1", "b0"]


def test_a_bomb_is_refused_without_a_pool_turn(redis_url: str, prefix: str) -> None:
    """Inline or from a blob, a bomb's header refuses it on the loop: the media pool runs
    nothing for it (no decoding thread spent), while a real image after it takes one turn."""

    async def main() -> list[int]:
        pool = MediaPool(1)
        done = []
        async with Client(redis_url, prefix=prefix) as client:
            await client.redis.set(client.keys.blob("bomb"), png_bomb())
            loader = MediaLoader(
                redis=client.redis,
                keys=client.keys,
                limits=DEFAULT_LIMITS,
                pool=pool,
                fetch=FetchPolicy(),
            )
            for source in (ImageInput(data=png_bomb()), ImageInput(blob="bomb")):
                with pytest.raises(MediaError, match="65535x65535 pixels, over max_image_pixels"):
                    await loader.load(_job((ImageInput(data=PNG), source)))
                done.append(pool.stats.done)
            await loader.load(_job((ImageInput(data=PNG),)))
            done.append(pool.stats.done)
        pool.close()
        return done

    # The good image before the bomb in each job is decoded (1 turn each); the bombs none.
    assert run(main()) == [1, 2, 3]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="niceness is per thread on Linux")
def test_media_threads_run_at_the_lowest_priority() -> None:
    """A tenant's decoding yields the CPU to the engine thread and the event loop."""

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def main() -> list[int]:
        pool = MediaPool(2)

        def niceness() -> int:
            return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

        found = await asyncio.gather(*(pool.run(f"t{i}", niceness) for i in range(4)))
        pool.close()
        return list(found)

    assert run(main()) == [LOWEST_NICENESS] * 4
    # Per thread: the caller's (the event loop's) priority stays as it was.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
