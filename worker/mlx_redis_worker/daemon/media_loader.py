"""A job's images and videos, from their sources to decoded frames, every step bounded.

1. Sizes first, reading nothing: each blob's ``STRLEN`` (a missing key, another type or one
   over its limit is refused here), each inline file's length; all against the job's
   ``max_media_bytes``.
2. The bytes: a blob read with ``GETRANGE`` up to its limit (a value swapped for a bigger one
   meanwhile is still cut at the limit, and refused), a URL fetched only from an allowed host
   (``media_fetch``), on a thread.
3. The image's header sniffed on the loop (``media.header``, no decoder): a format not
   allowed, or a decompression bomb's stated size, is refused here, without a pool turn.
4. Decoding (``mlx_redis_worker.media``) in the worker's ``MediaPool``, off the event loop and
   the engine thread, tenants taking turns, its threads at the lowest CPU priority.

Any refusal is a ``MediaError`` with the protocol's code; the job ends ``invalid_job``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from mlx_redis_protocol.connection import RedisClient
from mlx_redis_protocol.constants import DEFAULT_TENANT
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.limits import Limits
from mlx_redis_protocol.media_fetch import FetchPolicy, fetch_media
from mlx_redis_protocol.messages import ImageInput, Job, VideoInput
from mlx_redis_worker.daemon.media_pool import MediaPool
from mlx_redis_worker.media.errors import MediaError, missing_extra
from mlx_redis_worker.media.header import check_image_header


@dataclass
class LoadedMedia:
    """What the engine takes: RGB images, and each video as its list of frames."""

    images: list[Any] = field(default_factory=list)  # PIL.Image.Image
    videos: list[list[Any]] = field(default_factory=list)


@dataclass
class MediaCounts:
    """Media refused and decoded, by kind, for stats."""

    images: int = 0
    videos: int = 0
    frames: int = 0
    bytes: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # by error code


class MediaLoader:
    def __init__(
        self,
        *,
        redis: RedisClient,
        keys: Keys,
        limits: Limits,
        pool: MediaPool,
        fetch: FetchPolicy,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.limits = limits
        self.pool = pool
        self.fetch = fetch
        self.counts = MediaCounts()

    async def load(self, job: Job) -> LoadedMedia:
        try:
            return await self._load(job)
        except MediaError as exc:
            self.counts.refused[exc.code] = self.counts.refused.get(exc.code, 0) + 1
            raise

    async def _load(self, job: Job) -> LoadedMedia:
        images = job.images or ()
        videos = job.videos or ()
        files = _files(images, videos, self.limits)
        sizes = await self._sizes(files)
        total = sum(sizes)
        if total > self.limits.max_media_bytes:
            raise MediaError(
                "limit_exceeded",
                f"media are {total} bytes, over max_media_bytes ({self.limits.max_media_bytes})",
            )
        contents = [await self._bytes(item, what, most) for (what, item, most) in files]
        tenant = job.tenant or DEFAULT_TENANT
        loaded = LoadedMedia()
        index = 0
        for number, image in enumerate(images):
            data = contents[index]
            index += 1
            loaded.images.append(await self._image(tenant, data, f"images[{number}]", image.detail))
        for number, video in enumerate(videos):
            what = f"videos[{number}]"
            if video.frames is not None:
                frames = []
                for frame_number, frame in enumerate(video.frames):
                    data = contents[index]
                    index += 1
                    what_frame = f"{what}.frames[{frame_number}]"
                    frames.append(await self._image(tenant, data, what_frame, frame.detail))
            else:
                frames = await self._video(tenant, contents[index], what, video)
                index += 1
            self.counts.videos += 1
            self.counts.frames += len(frames)
            loaded.videos.append(frames)
        self.counts.bytes += sum(len(data) for data in contents)
        return loaded

    async def _sizes(self, files: list[tuple[str, ImageInput | VideoInput, int]]) -> list[int]:
        """Each file's size before anything is read: inline lengths, blobs' STRLEN (one round
        trip), URLs counted at their limit (known only as they download)."""
        blobs = [(what, item) for what, item, _ in files if item.blob is not None]
        lengths: dict[str, int] = {}
        if blobs:
            async with self.redis.pipeline(transaction=False) as pipe:
                for _, item in blobs:
                    assert item.blob is not None
                    pipe.type(self.keys.blob(item.blob))
                    pipe.strlen(self.keys.blob(item.blob))
                replies = await pipe.execute(raise_on_error=False)
            for index, (what, item) in enumerate(blobs):
                kind, length = replies[2 * index], replies[2 * index + 1]
                lengths[what] = _blob_length(what, item, kind, length)
        sizes = []
        for what, item, most in files:
            size = len(item.data) if item.data is not None else lengths.get(what, most)
            if size > most:
                raise MediaError("limit_exceeded", f"{what} is {size} bytes, over {most}")
            sizes.append(size)
        return sizes

    async def _bytes(self, item: ImageInput | VideoInput, what: str, most: int) -> bytes:
        if item.data is not None:
            return item.data
        if item.blob is not None:
            key = self.keys.blob(item.blob)
            data = await self.redis.getrange(key, 0, most)  # at most most + 1 bytes
            assert isinstance(data, bytes)  # the client decodes no responses
            if not data:
                raise MediaError("invalid_field", f"{what}.blob {item.blob!r}: no such blob")
            if len(data) > most:
                raise MediaError("limit_exceeded", f"{what}.blob is over {most} bytes")
            return data
        assert item.url is not None
        if not self.fetch.enabled:
            raise MediaError(
                "invalid_field",
                f"{what}.url: this worker fetches no URLs (its operator allows no host)",
            )
        url = item.url
        try:
            return await asyncio.to_thread(fetch_media, url, self.fetch, most, f"{what}.url")
        except ProtocolError as exc:
            raise MediaError(exc.code, exc.message) from None

    async def _image(self, tenant: str, data: bytes, what: str, detail: str | None) -> Any:
        check_image_header(data, self.limits, what=what)
        decode = _decoder("decode_image")
        image = await self.pool.run(
            tenant, lambda: decode(data, self.limits, what=what, detail=detail)
        )
        self.counts.images += 1
        return image

    async def _video(self, tenant: str, data: bytes, what: str, video: VideoInput) -> list[Any]:
        decode = _decoder("decode_video")
        frames: list[Any] = await self.pool.run(
            tenant,
            lambda: decode(
                data, self.limits, fps=video.fps, max_frames=video.max_frames, what=what
            ),
        )
        return frames


def engine_media(engine: Any) -> tuple[str, ...]:
    """The media an engine's model takes ("image", "video"): its ``supports_images`` (and
    ``supports_videos``, else the same); none for an engine without them (text only)."""
    images = bool(getattr(engine, "supports_images", False))
    videos = bool(getattr(engine, "supports_videos", images))
    return tuple(kind for kind, taken in (("image", images), ("video", videos)) if taken)


def _files(
    images: tuple[ImageInput, ...], videos: tuple[VideoInput, ...], limits: Limits
) -> list[tuple[str, ImageInput | VideoInput, int]]:
    """Every file of the job's media, in order, with its name and byte limit."""
    files: list[tuple[str, ImageInput | VideoInput, int]] = []
    for number, image in enumerate(images):
        files.append((f"images[{number}]", image, limits.max_image_bytes))
    for number, video in enumerate(videos):
        if video.frames is not None:
            files.extend(
                (f"videos[{number}].frames[{index}]", frame, limits.max_image_bytes)
                for index, frame in enumerate(video.frames)
            )
        else:
            files.append((f"videos[{number}]", video, limits.max_video_bytes))
    return files


def _blob_length(what: str, item: ImageInput | VideoInput, kind: Any, length: Any) -> int:
    if kind in (b"none", "none"):
        raise MediaError(
            "invalid_field", f"{what}.blob {item.blob!r}: no such blob (expired, or never stored)"
        )
    if isinstance(kind, bytes | str) and kind not in (b"string", "string"):
        raise MediaError("invalid_field", f"{what}.blob {item.blob!r} is not a string key")
    if isinstance(kind, Exception) or isinstance(length, Exception):
        raise MediaError("invalid_field", f"{what}.blob {item.blob!r} cannot be read")
    return int(length)


def _decoder(name: str) -> Any:
    """A decoder of ``mlx_redis_worker.media``, imported when a job first needs it (Pillow
    and PyAV: the vision extra)."""
    try:
        if name == "decode_image":
            from mlx_redis_worker.media.images import decode_image

            return decode_image
        from mlx_redis_worker.media.video import decode_video

        return decode_video
    except ImportError as exc:
        raise missing_extra(exc) from None
