"""Real image and video files for the media tests, made here with Pillow and PyAV, and the
hostile ones: a decompression bomb's header, cut files, a file that is no image."""

from __future__ import annotations

import io
import struct
import zlib
from typing import Any


def image_file(seed: int = 0, size: tuple[int, int] = (32, 24), fmt: str = "PNG") -> bytes:
    """A real image file of random pixels (the same for the same seed)."""
    import numpy as np
    from PIL import Image

    width, height = size
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format=fmt)
    return buffer.getvalue()


def png_bomb(width: int = 65535, height: int = 65535) -> bytes:
    """A PNG whose header says ``width`` x ``height`` over a few KB of data: decoding it
    would allocate width x height x 3 bytes (12.9 GB for the default)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = zlib.compress(b"\0" * 4096, 9)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")
    )


def video_file(frames: int = 30, rate: int = 10, size: tuple[int, int] = (64, 48)) -> bytes:
    """A real MP4 (MPEG-4 part 2) whose frame i is grey level 8 i: ``frames / rate`` s."""
    import av
    import numpy as np

    width, height = size
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as out:
        stream: Any = out.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(frames):
            pixels = np.full((height, width, 3), (index * 8) % 256, np.uint8)
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()
