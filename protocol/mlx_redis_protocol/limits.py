"""Size limits enforced while decoding, so no input can make a reader allocate without bound."""

from __future__ import annotations

from dataclasses import dataclass, fields

_MIB = 1024 * 1024
_KIB = 1024


@dataclass(frozen=True, slots=True)
class Limits:
    """Decode-time limits. The defaults suit one worker with a 32k-token context.

    The msgpack-level limits (``max_str_len``, ``max_bin_len``, ``max_array_len``,
    ``max_map_len``) are handed to msgpack itself, which refuses a too-long header before
    allocating anything; the field-level ones are checked on the decoded values.
    """

    max_message_bytes: int = _MIB
    max_str_len: int = 256 * _KIB
    # Any bin value: a logprob's token bytes, an image inline in a job (the message's own
    # size bounds it anyway).
    max_bin_len: int = _MIB
    max_array_len: int = 32768
    max_map_len: int = 256
    max_prompt_tokens: int = 32768
    max_messages: int = 256
    max_stop: int = 16
    max_stop_len: int = 256
    max_stop_token_ids: int = 256
    max_tokens: int = 32768
    max_logprobs: int = 20
    max_token_bytes: int = 1024  # one token's bytes, in a logprob
    max_metadata_bytes: int = 16 * _KIB
    max_metadata_depth: int = 8
    max_schema_depth: int = 32
    max_embedding_inputs: int = 2048  # an embedding job's ``input`` items
    # Images and videos of a job (docs/vision.md). The wire's own (counts, inline bytes,
    # sampling) are checked by the decoder; the rest by the worker, before it decodes a byte
    # of the media: a blob's STRLEN, a URL's length as it downloads, an image's header.
    max_images: int = 16  # images of one job
    max_videos: int = 4  # videos of one job
    max_content_parts: int = 64  # text/image/video parts of one chat turn
    max_image_bytes: int = 20 * _MIB  # one image's file, inline, blob or URL
    max_video_bytes: int = 64 * _MIB  # one video's file
    max_media_bytes: int = 128 * _MIB  # all media files of one job together
    max_image_pixels: int = 32 * _MIB  # width x height of one image or video frame
    max_video_frames: int = 64  # frames sampled from one video, or of a frame list
    max_video_seconds: int = 600  # a video file's duration
    max_video_fps: int = 30  # the sampling rate a job may ask for (frames per second)
    max_url_len: int = 2048  # a media URL

    def __post_init__(self) -> None:
        for limit in fields(self):
            name, value = limit.name, getattr(self, limit.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive integer, got {value!r}")


DEFAULT_LIMITS = Limits()
