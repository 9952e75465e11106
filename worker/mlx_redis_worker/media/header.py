"""An image's refusals that need no decoder: its format signature and the size its header
states. Pure Python (no Pillow), cheap enough for the event loop: a decompression bomb is
refused here without a media pool turn, so a tenant's bombs cost no decoding thread."""

from __future__ import annotations

from mlx_redis_protocol.limits import Limits
from mlx_redis_protocol.media_formats import IMAGE_FORMATS, image_format, image_size
from mlx_redis_worker.media.errors import MediaError

ALLOWED = ", ".join(name.lower() for name in IMAGE_FORMATS)


def check_image_header(data: bytes, limits: Limits, *, what: str = "image") -> str:
    """The image's format (one of ``IMAGE_FORMATS``); ``MediaError`` when it is no allowed
    format or its header states more than ``max_image_pixels``."""
    found = image_format(data)
    if found is None:
        raise MediaError(
            "invalid_field", f"{what} is not an image of an allowed format ({ALLOWED})"
        )
    size = image_size(data)
    if size is not None:
        check_pixels(size, limits, what=what)
    return found


def check_pixels(size: tuple[int, int], limits: Limits, *, what: str) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise MediaError("invalid_field", f"{what} is {width}x{height} pixels")
    if width * height > limits.max_image_pixels:
        raise MediaError(
            "limit_exceeded",
            f"{what} is {width}x{height} pixels, over max_image_pixels ({limits.max_image_pixels})",
        )
