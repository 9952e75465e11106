"""A producer's images and videos made into a job's: files read (bounded), big ones stored.

``Client.submit(images=[…], videos=[…])`` takes bytes, paths, ``ImageInput``/``VideoInput``
or (a video) a list of frames. A file over the inline threshold, or one that would take the
job's inline bytes over its budget, is stored under a blob key with a TTL and referenced, so
the stream entry stays small (docs/vision.md).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.identifiers import new_request_id
from mlx_redis_protocol.limits import Limits
from mlx_redis_protocol.media_formats import (
    IMAGE_FORMATS,
    VIDEO_FORMATS,
    image_format,
    video_format,
)
from mlx_redis_protocol.messages import ImageInput, VideoInput

ImageLike = bytes | str | os.PathLike[str] | ImageInput
VideoLike = bytes | str | os.PathLike[str] | VideoInput | Sequence[ImageLike]

# A file of more bytes goes to a blob instead of the job (the entry stays small).
DEFAULT_INLINE_MEDIA_BYTES: Final = 256 * 1024
# The most inline bytes a job carries, all its files together: well under the 1 MiB message.
INLINE_BUDGET_BYTES: Final = 512 * 1024
# How long a stored blob lives: longer than a job should wait in the queue.
DEFAULT_BLOB_TTL_SECONDS: Final = 3600


def image_input(item: ImageLike, limits: Limits, what: str = "image") -> ImageInput:
    """An image of a job from bytes, a path or an ``ImageInput`` (as it is)."""
    if isinstance(item, ImageInput):
        return item
    data = _file_bytes(item, limits.max_image_bytes, what)
    _check_format(data, image_format(data), IMAGE_FORMATS, what)
    return ImageInput(data=data)


def video_input(item: VideoLike, limits: Limits, what: str = "video") -> VideoInput:
    """A video of a job: a file (bytes, path), a ``VideoInput`` as it is, or a list of
    frames (each image-like)."""
    if isinstance(item, VideoInput):
        return item
    if isinstance(item, bytes | str | os.PathLike):
        data = _file_bytes(item, limits.max_video_bytes, what)
        _check_format(data, video_format(data), VIDEO_FORMATS, what)
        return VideoInput(data=data)
    frames = tuple(image_input(frame, limits, f"{what} frame") for frame in item)
    return VideoInput(frames=frames)


def media_bytes(images: Sequence[ImageInput], videos: Sequence[VideoInput]) -> int:
    """The inline bytes of a job's media files, all together."""
    files: list[ImageInput | VideoInput] = [*images, *videos]
    files.extend(frame for video in videos for frame in video.frames or ())
    return sum(len(item.data) for item in files if item.data is not None)


def _check_format(data: bytes, found: str | None, allowed: Sequence[str], what: str) -> None:
    if found is None:
        raise ProtocolError(
            "invalid_field", f"{what} is not of an allowed format ({', '.join(allowed).lower()})"
        )


def _file_bytes(item: bytes | str | os.PathLike[str], most: int, what: str) -> bytes:
    if isinstance(item, bytes):
        if len(item) > most:
            raise ProtocolError("limit_exceeded", f"{what} is over {most} bytes")
        return item
    path = Path(item)
    try:
        size = path.stat().st_size
        if size > most:
            raise ProtocolError("limit_exceeded", f"{what} {str(path)!r} is over {most} bytes")
        with path.open("rb") as file:
            data = file.read(most + 1)  # bounded, whatever the file became since stat
    except OSError as exc:
        raise ProtocolError("invalid_field", f"{what} {str(path)!r}: {exc.strerror}") from None
    if len(data) > most:
        raise ProtocolError("limit_exceeded", f"{what} {str(path)!r} is over {most} bytes")
    return data


@dataclass
class StagedMedia:
    """A job's media with its big files replaced by blob references, and those files (blob
    id -> bytes) to store before the job is queued."""

    images: tuple[ImageInput, ...] | None
    videos: tuple[VideoInput, ...] | None
    blobs: dict[str, bytes]


def stage_media(
    images: Sequence[ImageInput],
    videos: Sequence[VideoInput],
    inline_bytes: int = DEFAULT_INLINE_MEDIA_BYTES,
    budget: int = INLINE_BUDGET_BYTES,
) -> StagedMedia:
    """Each inline file over ``inline_bytes``, or past the job's inline ``budget``, moved to
    a new blob (not stored yet: see ``StagedMedia.blobs``)."""
    blobs: dict[str, bytes] = {}
    inline = 0

    def staged(item: ImageInput | VideoInput) -> str | None:
        nonlocal inline
        data = item.data
        if data is None:
            return None
        if len(data) <= inline_bytes and inline + len(data) <= budget:
            inline += len(data)
            return None
        blob = new_request_id()
        blobs[blob] = data
        return blob

    def image(item: ImageInput) -> ImageInput:
        blob = staged(item)
        return item if blob is None else replace(item, data=None, blob=blob)

    def video(item: VideoInput) -> VideoInput:
        if item.frames is not None:
            return replace(item, frames=tuple(image(frame) for frame in item.frames))
        blob = staged(item)
        return item if blob is None else replace(item, data=None, blob=blob)

    made_images = tuple(image(item) for item in images)
    made_videos = tuple(video(item) for item in videos)
    return StagedMedia(made_images or None, made_videos or None, blobs)


def prepare_media(
    images: Sequence[ImageLike],
    videos: Sequence[VideoLike],
    limits: Limits,
    inline_bytes: int = DEFAULT_INLINE_MEDIA_BYTES,
) -> StagedMedia:
    """A producer's images and videos as a job's: files read (bounded), formats sniffed,
    the job's total checked, big files moved to blobs to store. ProtocolError for what
    cannot go, before anything reaches Redis."""
    made_images = tuple(image_input(item, limits, f"images[{i}]") for i, item in enumerate(images))
    made_videos = tuple(video_input(item, limits, f"videos[{i}]") for i, item in enumerate(videos))
    if media_bytes(made_images, made_videos) > limits.max_media_bytes:
        raise ProtocolError(
            "limit_exceeded", f"the job's media are over max_media_bytes ({limits.max_media_bytes})"
        )
    return stage_media(made_images, made_videos, inline_bytes)
