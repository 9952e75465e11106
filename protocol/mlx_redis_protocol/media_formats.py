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


# The most bytes ``image_size`` reads: a header past them (a JPEG behind 64 KB of metadata)
# is left to the decoder's own header read.
SNIFF_BYTES: Final = 64 * 1024
_JPEG_FRAMES: Final = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB))
_JPEG_FRAMES_MORE: Final = frozenset((0xCD, 0xCE, 0xCF))
_JPEG_BARE: Final = frozenset((0x01, *range(0xD0, 0xD8)))  # markers without a length


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) as the file's header states it, read from its first ``SNIFF_BYTES``
    with no decoder; None when not found there. A lower bound at most (a GIF's frame may
    outgrow its screen), so it may refuse a file early, never accept one: the decoder's own
    header read still follows."""
    head = data[:SNIFF_BYTES]
    found = image_format(head)
    if found == "PNG":
        if head[12:16] != b"IHDR" or len(head) < 24:
            return None
        return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    if found == "GIF" and len(head) >= 10:
        return head[6] | head[7] << 8, head[8] | head[9] << 8
    if found == "WEBP":
        return _webp_size(head)
    if found == "JPEG":
        return _jpeg_size(head)
    return None


def _webp_size(head: bytes) -> tuple[int, int] | None:
    chunk = head[12:16]
    if chunk == b"VP8X" and len(head) >= 30:
        return 1 + int.from_bytes(head[24:27], "little"), 1 + int.from_bytes(head[27:30], "little")
    if chunk == b"VP8L" and len(head) >= 25 and head[20] == 0x2F:
        bits = int.from_bytes(head[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + (bits >> 14 & 0x3FFF)
    if chunk == b"VP8 " and len(head) >= 30 and head[23:26] == b"\x9d\x01\x2a":
        width = int.from_bytes(head[26:28], "little") & 0x3FFF
        return width, int.from_bytes(head[28:30], "little") & 0x3FFF
    return None


def _jpeg_size(head: bytes) -> tuple[int, int] | None:
    """The first frame header's size, walking the segments from the start."""
    at = 2
    while at + 4 <= len(head):
        if head[at] != 0xFF:
            return None  # not a marker where one must be: the decoder says what is wrong
        marker = head[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in _JPEG_BARE:
            at += 2
            continue
        length = int.from_bytes(head[at + 2 : at + 4], "big")
        if marker in _JPEG_FRAMES or marker in _JPEG_FRAMES_MORE:
            if at + 9 > len(head):
                return None
            height = int.from_bytes(head[at + 5 : at + 7], "big")
            return int.from_bytes(head[at + 7 : at + 9], "big"), height
        if length < 2:
            return None
        at += 2 + length
    return None
