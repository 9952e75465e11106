"""The file formats a job's images and videos may be in, told from their first bytes.

Only a sniff of the signature (no decoding, no PIL): the decoder refuses an inline file that
is no allowed format, a gateway refuses it before it queues anything, and the worker's
decoder opens each file only with the one format its signature names.
"""

from __future__ import annotations

from typing import Final

# The image formats a job may carry (PIL's names); anything else is refused unread.
IMAGE_FORMATS: Final = ("PNG", "JPEG", "WEBP", "GIF")
# The video containers (PyAV's names of the demuxers that read them).
VIDEO_FORMATS: Final = ("mp4", "webm")


def image_format(data: bytes) -> str | None:
    """The image format whose signature ``data`` starts with, or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def video_format(data: bytes) -> str | None:
    """The video container whose signature ``data`` starts with, or None: ``mp4`` (ISO base
    media: MP4, MOV, 3GP), ``webm`` (Matroska / WebM)."""
    if data[4:8] == b"ftyp":
        return "mp4"
    if data.startswith(b"\x1a\x45\xdf\xa3"):
        return "webm"
    return None
