"""``image_size``: an image's stated size from its header, with no decoder, read from at most
``SNIFF_BYTES``; it agrees with Pillow on real files and never raises on hostile bytes."""

from __future__ import annotations

import io
import random

import pytest
from PIL import Image

from mlx_redis_protocol.media_formats import SNIFF_BYTES, image_size
from tests.support.media import image_file, png_bomb


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_the_stated_size_is_pillows(fmt: str) -> None:
    for size in ((1, 1), (321, 123), (640, 17)):
        data = image_file(3, size, fmt)
        assert image_size(data) == Image.open(io.BytesIO(data)).size == size


@pytest.mark.parametrize("options", [{"lossless": True}, {"exif": b"Exif\0\0tag"}])
def test_webp_lossless_and_extended(options: dict[str, object]) -> None:
    buffer = io.BytesIO()
    Image.new("RGBA", (300, 200)).save(buffer, "WEBP", **options)
    assert image_size(buffer.getvalue()) == (300, 200)


def test_a_bombs_size_from_its_header() -> None:
    assert image_size(png_bomb()) == (65535, 65535)
    assert image_size(png_bomb(8000, 5000)) == (8000, 5000)


def test_a_header_past_the_sniffed_bytes_is_not_looked_for() -> None:
    """A JPEG whose frame header lies behind 80 KB of application segments: None (the
    decoder reads it), not a walk through the whole file."""
    jpeg = image_file(4, (64, 48), "JPEG")
    segment = b"\xff\xe2" + (40_002).to_bytes(2, "big") + bytes(40_000)
    padded = jpeg[:2] + segment * 2 + jpeg[2:]
    assert len(padded) > SNIFF_BYTES
    assert image_size(padded) is None
    assert image_size(jpeg[:2] + segment + jpeg[2:]) == (64, 48)  # within: found


def test_hostile_bytes_give_none_or_a_size_never_an_error() -> None:
    files = [image_file(5, (50, 40), fmt) for fmt in ("PNG", "JPEG", "GIF", "WEBP")]
    chance = random.Random(7)
    for data in files:
        for cut in range(0, 64):
            found = image_size(data[:cut])
            assert found is None or found == (50, 40)
        for _ in range(200):
            noisy = bytearray(data[:200])
            noisy[chance.randrange(2, 200)] = chance.randrange(256)
            found = image_size(bytes(noisy))
            assert found is None or all(0 <= side < 1 << 32 for side in found)
    assert image_size(b"") is None
    assert image_size(b"%PDF-1.4") is None
