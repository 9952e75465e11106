"""Image files for the isolation bench's image attackers (and the tests): a decompression
bomb's header, a "50 MB image", and real pictures of random pixels."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from typing import Final

# What a "50 MB image" attacker sends: a PNG signature over 50 MB (no real decoder gets
# past the header, and every limit should refuse it before one tries).
HUGE_IMAGE_BYTES: Final = 50 * 1024 * 1024


def png_bomb(width: int = 65535, height: int = 65535) -> bytes:
    """A PNG whose header says ``width`` x ``height`` over a few KB of data: decoding it
    would allocate width x height x 3 bytes (12.9 GB for the default)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = zlib.compress(b"\0" * 4096, 9)
    signature = b"\x89PNG\r\n\x1a\n"
    return signature + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def huge_image() -> bytes:
    """``HUGE_IMAGE_BYTES`` that start as a PNG."""
    return b"\x89PNG\r\n\x1a\n" + bytes(HUGE_IMAGE_BYTES - 8)


def picture(seed: int, size: tuple[int, int] = (32, 24), fmt: str = "PNG") -> bytes:
    """A real image file of random pixels (the same for the same seed); needs Pillow."""
    import numpy as np
    from PIL import Image

    width, height = size
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format=fmt)
    return buffer.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    """``data`` as a ``data:image/KIND;base64,…`` URL."""
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"
