"""``decode_video``: a video file's untrusted bytes made into sampled RGB frames (PyAV).

Checked before any frame is decoded: the file's size, its container (the signature names one
of ``VIDEO_FORMATS``, and only that demuxer reads it), a video stream of an allowed codec,
its frame size and its stated duration. While decoding, every frame's size and time are
checked again (a stream may change size, or lie about its length), and the frames decoded
are counted: a file never costs more than ``max_video_seconds`` at ``MAX_DECODED_FPS``.
Frames are sampled ``fps`` per second, at most ``max_frames``, spread over the whole video
when there are more.
"""

from __future__ import annotations

import io
import math
from typing import Any, Final

import av
from PIL import Image

from mlx_redis_protocol.limits import Limits
from mlx_redis_protocol.media_formats import VIDEO_FORMATS, video_format
from mlx_redis_protocol.messages import DEFAULT_VIDEO_FPS
from mlx_redis_worker.media.errors import MediaError

# Codecs whose decoders FFmpeg's wheels carry and cameras and browsers write.
VIDEO_CODECS: Final = ("h264", "hevc", "vp8", "vp9", "av1", "libdav1d", "mpeg4")
# The most frames per second of video a decode may go through (the work bound).
MAX_DECODED_FPS: Final = 60


def decode_video(
    data: bytes,
    limits: Limits,
    *,
    fps: float | None = None,
    max_frames: int | None = None,
    what: str = "video",
) -> list[Image.Image]:
    """Frames of the video in ``data``, ``fps`` per second (default ``DEFAULT_VIDEO_FPS``),
    at most ``max_frames`` (and ``limits.max_video_frames``). ``MediaError`` for anything
    refused; never another exception for any bytes."""
    if len(data) > limits.max_video_bytes:
        raise MediaError(
            "limit_exceeded",
            f"{what} is {len(data)} bytes, over max_video_bytes ({limits.max_video_bytes})",
        )
    container = _open(data, what)
    try:
        stream = _video_stream(container, what)
        _check_size(stream.codec_context.width, stream.codec_context.height, limits, what)
        duration = _duration(container, stream)
        if duration is not None and duration > limits.max_video_seconds:
            raise MediaError(
                "limit_exceeded",
                f"{what} lasts {duration:.1f} s, over max_video_seconds "
                f"({limits.max_video_seconds})",
            )
        most = min(max_frames or limits.max_video_frames, limits.max_video_frames)
        return _sample(container, stream, duration, fps or DEFAULT_VIDEO_FPS, most, limits, what)
    except MediaError:
        raise
    except Exception as exc:  # FFmpeg's errors for hostile bytes: all mean "unreadable"
        raise MediaError("invalid_field", f"{what} is corrupt or truncated ({_why(exc)})") from None
    finally:
        container.close()


def _open(data: bytes, what: str) -> Any:
    found = video_format(data)
    if found is None:
        allowed = ", ".join(VIDEO_FORMATS)
        raise MediaError("invalid_field", f"{what} is not a video of an allowed format ({allowed})")
    try:
        return av.open(io.BytesIO(data), format=found)
    except Exception as exc:
        raise MediaError(
            "invalid_field", f"{what} is not a readable {found} ({_why(exc)})"
        ) from None


def _video_stream(container: Any, what: str) -> Any:
    if not container.streams.video:
        raise MediaError("invalid_field", f"{what} has no video stream")
    stream = container.streams.video[0]
    name = stream.codec_context.name
    if name not in VIDEO_CODECS:
        raise MediaError(
            "invalid_field", f"{what} is {name}, not a codec allowed ({', '.join(VIDEO_CODECS)})"
        )
    stream.thread_count = 1  # the decode pool is the CPU budget: one core per decode
    return stream


def _check_size(width: int, height: int, limits: Limits, what: str) -> None:
    if width < 1 or height < 1:
        raise MediaError("invalid_field", f"{what} has frames of {width}x{height} pixels")
    if width * height > limits.max_image_pixels:
        raise MediaError(
            "limit_exceeded",
            f"{what} has frames of {width}x{height} pixels, over max_image_pixels "
            f"({limits.max_image_pixels})",
        )


def _duration(container: Any, stream: Any) -> float | None:
    """The stated duration in seconds (the stream's, else the container's), or None."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return float(container.duration / av.time_base)
    return None


def _sample(
    container: Any,
    stream: Any,
    duration: float | None,
    fps: float,
    most: int,
    limits: Limits,
    what: str,
) -> list[Image.Image]:
    """Decode in order, keeping the first frame at or after each sampling time."""
    times = sampling_times(duration, fps, most)
    frames: list[Image.Image] = []
    budget = limits.max_video_seconds * MAX_DECODED_FPS
    next_time = 0
    for index, frame in enumerate(container.decode(stream)):
        if index >= budget:
            raise MediaError(
                "limit_exceeded", f"{what} has over {budget} frames to decode (max_video_seconds)"
            )
        at = float(frame.time) if frame.time is not None else index / MAX_DECODED_FPS
        if at > limits.max_video_seconds:
            raise MediaError(
                "limit_exceeded",
                f"{what} runs past max_video_seconds ({limits.max_video_seconds})",
            )
        if at + 1e-6 < times[next_time]:
            continue
        _check_size(frame.width, frame.height, limits, what)
        frames.append(frame.to_image())
        while next_time < len(times) and times[next_time] <= at + 1e-6:
            next_time += 1  # a time this frame covers (or a gap in the video skipped)
        if next_time >= len(times):
            break
    if not frames:
        raise MediaError("invalid_field", f"{what} has no frame that decodes")
    return frames


def sampling_times(duration: float | None, fps: float, most: int) -> list[float]:
    """When to take frames (seconds): every 1/fps, or ``most`` spread evenly over the video
    when that gives more; without a known duration, the first ``most`` at 1/fps."""
    if duration is None or duration <= 0:
        return [index / fps for index in range(most)]
    count = min(most, max(1, math.ceil(duration * fps - 1e-9)))
    step = max(duration / count, 1 / fps)
    return [index * step for index in range(count)]


def _why(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
