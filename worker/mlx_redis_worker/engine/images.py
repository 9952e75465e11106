"""An image given to the engine API as a PIL image, encoded bytes or a file path, as the RGB
``PIL.Image.Image`` the processor takes.

The daemon hands the engine images it has already checked and decoded; bytes and paths come
from direct users of ``EngineCore``, and go through the worker's one bounded decoder
(``mlx_redis_worker.media.decode_image``) with the default limits, as a job's would.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image


def as_rgb_image(source: Any) -> Image.Image:
    """``source`` (a PIL image, encoded bytes, or a path) as an RGB image; ``ValueError`` for
    anything else, for a file over the default limits or one that is not a readable image.
    (Pillow comes with the vision extra: a text-only worker never imports it.)"""
    from PIL import Image

    from mlx_redis_protocol.limits import Limits
    from mlx_redis_worker.media.images import decode_image

    if isinstance(source, Image.Image):
        return source if source.mode == "RGB" else source.convert("RGB")
    limits = Limits()
    if isinstance(source, bytes | bytearray | memoryview):
        return decode_image(bytes(source), limits)
    if isinstance(source, str | os.PathLike):
        path = os.fspath(source)
        try:
            with open(path, "rb") as file:  # one byte past the limit: over it, refused
                data = file.read(limits.max_image_bytes + 1)
        except OSError as exc:
            raise ValueError(f"image file {path!r}: {exc.strerror or exc}") from exc
        return decode_image(data, limits, what=f"image file {path!r}")
    raise ValueError(
        f"an image must be a PIL image, bytes or a file path, not {type(source).__name__}"
    )
