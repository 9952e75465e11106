"""Test images: random pixels from a seed, so two seeds are two different pictures."""

from __future__ import annotations

from typing import Any

import numpy as np


def picture(seed: int, width: int = 64, height: int = 64) -> Any:
    """An RGB ``PIL.Image.Image`` of random pixels (the same for the same arguments)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def png_bytes(seed: int, width: int = 64, height: int = 64) -> bytes:
    """``picture``'s PNG file."""
    import io

    buffer = io.BytesIO()
    picture(seed, width, height).save(buffer, format="PNG")
    return buffer.getvalue()
