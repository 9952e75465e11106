"""An image given to the engine API as a PIL image, encoded bytes or a file path, as the RGB
``PIL.Image.Image`` the processor takes.

The daemon hands the engine images it has already checked and decoded (bounded bytes, pixels
and formats: the worker's own hostile-input rules), so this is for direct users of
``EngineCore``. PLACEHOLDER: the minimal decode below is the one place the engine turns bytes
or paths into pixels; the bounded decoder of the wire side (issue 36, its wire half) replaces
its body, and nothing else in the engine decodes images.
"""

from __future__ import annotations

import io
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image


def as_rgb_image(source: Any) -> Image.Image:
    """``source`` (a PIL image, encoded bytes, or a path) as an RGB image; ``ValueError`` for
    anything else or for bytes PIL cannot read. (Pillow comes with the vision extra: a
    text-only worker never imports it.)"""
    from PIL import Image

    if isinstance(source, Image.Image):
        image = source
    elif isinstance(source, bytes | bytearray | memoryview):
        image = _open(io.BytesIO(bytes(source)), "image bytes")
    elif isinstance(source, str | os.PathLike):
        image = _open(os.fspath(source), f"image file {os.fspath(source)!r}")
    else:
        raise ValueError(
            f"an image must be a PIL image, bytes or a file path, not {type(source).__name__}"
        )
    return image if image.mode == "RGB" else image.convert("RGB")


def _open(source: Any, what: str) -> Image.Image:
    from PIL import Image

    try:
        image = Image.open(source)
        image.load()
    except (OSError, Image.DecompressionBombError, ValueError) as exc:
        raise ValueError(f"{what}: not a readable image ({exc})") from exc
    return image
