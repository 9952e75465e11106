"""A job's images and videos on the wire, and the media parts of its chat turns.

The decoder checks what the message itself shows: one source per item, counts, inline bytes
(their size and format signature), blob ids, URLs, sampling. What needs the media's bytes
from elsewhere (a blob's size, a URL's answer) or a decoder (an image's pixels, a video's
duration) is the worker's, before it decodes anything (docs/vision.md).
"""

from __future__ import annotations

from typing import Any, Final

from mlx_redis_protocol.fields import FieldReader
from mlx_redis_protocol.identifiers import ID_RULE, is_valid_id
from mlx_redis_protocol.media_formats import (
    IMAGE_FORMATS,
    VIDEO_FORMATS,
    image_format,
    video_format,
)
from mlx_redis_protocol.messages import (
    IMAGE_DETAILS,
    ChatMessage,
    ContentPart,
    ImageInput,
    VideoInput,
)

SOURCES: Final = ("data", "blob", "url")
_URL_SCHEMES: Final = ("http://", "https://")
_PART_TYPES: Final = ("text", "image", "video")


def encode_image(image: ImageInput) -> dict[str, Any]:
    fields: dict[str, Any] = _source_fields(image.data, image.blob, image.url)
    if image.detail is not None:
        fields["detail"] = image.detail
    return fields


def encode_video(video: VideoInput) -> dict[str, Any]:
    fields = _source_fields(video.data, video.blob, video.url)
    if video.frames is not None:
        fields["frames"] = [encode_image(frame) for frame in video.frames]
    if video.fps is not None:
        fields["fps"] = video.fps
    if video.max_frames is not None:
        fields["max_frames"] = video.max_frames
    return fields


def encode_parts(message: ChatMessage) -> list[dict[str, Any]]:
    """A turn's parts as the wire has them (its ``content`` array)."""
    assert message.parts is not None
    return [
        {"type": "text", "text": part.text} if part.type == "text" else {"type": part.type}
        for part in message.parts
    ]


def _source_fields(data: bytes | None, blob: str | None, url: str | None) -> dict[str, Any]:
    named = {"data": data, "blob": blob, "url": url}
    return {name: value for name, value in named.items() if value is not None}


def read_images(reader: FieldReader) -> tuple[ImageInput, ...] | None:
    limits = reader.limits
    items = reader.array("images", max_items=limits.max_images, min_items=1)
    if items is None:
        return None
    budget = _InlineBudget(reader)
    return tuple(_image(reader, f"images[{i}]", item, budget) for i, item in enumerate(items))


def read_videos(
    reader: FieldReader, images: tuple[ImageInput, ...] | None
) -> tuple[VideoInput, ...] | None:
    limits = reader.limits
    items = reader.array("videos", max_items=limits.max_videos, min_items=1)
    if items is None:
        return None
    budget = _InlineBudget(reader)
    budget.used = sum(len(image.data) for image in images or () if image.data is not None)
    return tuple(_video(reader, f"videos[{i}]", item, budget) for i, item in enumerate(items))


class _InlineBudget:
    """The inline bytes of a job's media, against ``max_media_bytes``."""

    def __init__(self, reader: FieldReader) -> None:
        self.reader = reader
        self.used = 0

    def spend(self, name: str, size: int) -> None:
        self.used += size
        most = self.reader.limits.max_media_bytes
        if self.used > most:
            raise self.reader.error(
                "limit_exceeded", name, f"takes the job's media over max_media_bytes ({most})"
            )


def _image(reader: FieldReader, name: str, item: object, budget: _InlineBudget) -> ImageInput:
    where = reader.nested(name, item)
    data, blob, url = _source(where, "image", reader.limits.max_image_bytes, budget, name)
    detail = where.string("detail")
    if detail is not None and detail not in IMAGE_DETAILS:
        raise where.error("invalid_field", "detail", f"must be one of {', '.join(IMAGE_DETAILS)}")
    return ImageInput(data=data, blob=blob, url=url, detail=detail)


def _video(reader: FieldReader, name: str, item: object, budget: _InlineBudget) -> VideoInput:
    where = reader.nested(name, item)
    limits = reader.limits
    frames_given = where.has("frames")
    if frames_given and any(where.has(source) for source in SOURCES):
        raise where.error("conflicting_fields", "frames", "cannot go with data, blob or url")
    if frames_given:
        for field in ("fps", "max_frames"):
            if where.has(field):
                raise where.error("conflicting_fields", field, "is for a video file, not frames")
        items = where.array("frames", max_items=limits.max_video_frames, min_items=1)
        assert items is not None
        frames = tuple(
            _image(where, f"frames[{i}]", frame, budget) for i, frame in enumerate(items)
        )
        return VideoInput(frames=frames)
    data, blob, url = _source(where, "video", limits.max_video_bytes, budget, name)
    fps = where.number("fps", above=0.0, maximum=float(limits.max_video_fps))
    max_frames = where.integer("max_frames", minimum=1)
    if max_frames is not None and max_frames > limits.max_video_frames:
        raise where.error("limit_exceeded", "max_frames", f"is over {limits.max_video_frames}")
    return VideoInput(data=data, blob=blob, url=url, fps=fps, max_frames=max_frames)


def _source(
    where: FieldReader, kind: str, max_bytes: int, budget: _InlineBudget, name: str
) -> tuple[bytes | None, str | None, str | None]:
    """The item's one source: inline bytes, a blob id or a URL."""
    given = [source for source in SOURCES if where.has(source)]
    if not given:
        raise where.error("missing_field", "data", "(or blob or url) is needed")
    if len(given) > 1:
        raise where.error("conflicting_fields", given[1], f"cannot go with {given[0]}")
    data = where.message.get("data")
    if data is not None:
        if not isinstance(data, bytes):
            raise where.error("invalid_field", "data", "must be bin (the file's bytes)")
        if len(data) > max_bytes:
            raise where.error("limit_exceeded", "data", f"is over {max_bytes} bytes")
        sniff, allowed = (
            (image_format, IMAGE_FORMATS) if kind == "image" else (video_format, VIDEO_FORMATS)
        )
        if sniff(data) is None:
            raise where.error(
                "invalid_field",
                "data",
                f"is not {kind} data of an allowed format ({', '.join(allowed).lower()})",
            )
        budget.spend(name, len(data))
        return data, None, None
    blob = where.string("blob")
    if blob is not None:
        if not is_valid_id(blob):
            raise where.error("invalid_field", "blob", f"must be {ID_RULE}")
        return None, blob, None
    url = where.string("url", max_len=where.limits.max_url_len)
    assert url is not None
    if not url.lower().startswith(_URL_SCHEMES):
        raise where.error("invalid_field", "url", "must be an http:// or https:// URL")
    return None, None, url


def read_content(turn: FieldReader) -> tuple[str | None, tuple[ContentPart, ...] | None]:
    """A turn's ``content``: a string, or an array of text, image and video parts. Returns
    its text and, when it places any media, its parts."""
    value = turn.message.get("content")
    if not isinstance(value, list):
        return turn.string("content", max_len=turn.limits.max_str_len), None
    items = turn.array("content", max_items=turn.limits.max_content_parts, min_items=1)
    assert items is not None
    parts = []
    for index, item in enumerate(items):
        where = turn.nested(f"content[{index}]", item)
        kind = where.required_string("type")
        if kind not in _PART_TYPES:
            raise where.error("invalid_field", "type", f"must be one of {', '.join(_PART_TYPES)}")
        text = where.string("text", max_len=turn.limits.max_str_len) if kind == "text" else None
        parts.append(ContentPart(kind, text or ""))  # type: ignore[arg-type]
    text = "".join(part.text for part in parts)
    if len(text.encode()) > turn.limits.max_str_len:
        raise turn.error("limit_exceeded", "content", f"is over {turn.limits.max_str_len} bytes")
    placed = any(part.type != "text" for part in parts)
    return text, tuple(parts) if placed else None


def check_placements(
    reader: FieldReader,
    messages: tuple[ChatMessage, ...] | None,
    images: tuple[ImageInput, ...] | None,
    videos: tuple[VideoInput, ...] | None,
) -> None:
    """A chat places no more images (videos) than the job carries."""
    for kind, media in (("image", images), ("video", videos)):
        places = sum(
            1 for message in messages or () for part in message.parts or () if part.type == kind
        )
        if places > len(media or ()):
            raise reader.error(
                "invalid_field",
                "messages",
                f"place {places} {kind}(s) but the job carries {len(media or ())}",
            )
