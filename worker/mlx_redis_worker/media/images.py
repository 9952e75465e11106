"""``decode_image``: an image file's untrusted bytes made into an RGB ``PIL.Image.Image``.

Every check that can come before decoding does: the file's size, its format (the signature
must be one of ``IMAGE_FORMATS``, and Pillow is allowed only that one format's plugin), its
width x height as the header states it (a 65,535 x 65,535 PNG of a few KB is refused here,
before ``load`` would allocate 17 GB). Only then are the pixels decoded; a file that is
corrupt or cut short is refused then. Pillow's own bomb check (``MAX_IMAGE_PIXELS``) stays
on as a second line.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, ImageOps

from mlx_redis_protocol.limits import Limits
from mlx_redis_protocol.messages import LOW_DETAIL_SIDE
from mlx_redis_worker.media.errors import MediaError
from mlx_redis_worker.media.header import check_image_header, check_pixels

# Pillow warns of an image past MAX_IMAGE_PIXELS (and raises past twice that); our own
# max_image_pixels check decides (a warning filter per call would not be thread-safe).
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def decode_image(
    data: bytes, limits: Limits, *, what: str = "image", detail: str | None = None
) -> Image.Image:
    """The image in ``data`` as RGB (EXIF orientation applied). ``detail="low"``: shrunk to
    fit ``LOW_DETAIL_SIDE`` pixels a side (a JPEG is decoded at that scale, cheaper).
    ``MediaError`` for anything refused; never another exception for any bytes."""
    if len(data) > limits.max_image_bytes:
        raise MediaError(
            "limit_exceeded",
            f"{what} is {len(data)} bytes, over max_image_bytes ({limits.max_image_bytes})",
        )
    image = open_image(data, limits, what=what)
    if detail == "low":
        # A JPEG decodes at 1/2, 1/4 or 1/8 scale for free: ask for at least the low size.
        image.draft("RGB", (LOW_DETAIL_SIDE, LOW_DETAIL_SIDE))
    try:
        image.load()
        oriented = ImageOps.exif_transpose(image)
        rgb = oriented.convert("RGB")
    except Exception as exc:  # hostile bytes raise anything: all mean "not a readable image"
        raise MediaError("invalid_field", f"{what} is corrupt or truncated ({_why(exc)})") from None
    if detail == "low":
        rgb.thumbnail((LOW_DETAIL_SIDE, LOW_DETAIL_SIDE))
    return rgb


def open_image(data: bytes, limits: Limits, *, what: str = "image") -> Image.Image:
    """The image's header read (no pixel decoded): its format is allowed and its size
    within ``max_image_pixels`` (first as ``check_image_header`` sniffs it, then as Pillow
    reads it). The image is lazy until ``load``."""
    found = check_image_header(data, limits, what=what)
    try:
        image = Image.open(io.BytesIO(data), formats=[found])
    except Image.DecompressionBombError:
        raise MediaError(
            "limit_exceeded",
            f"{what} has more pixels than max_image_pixels ({limits.max_image_pixels})",
        ) from None
    except Exception as exc:
        raise MediaError(
            "invalid_field", f"{what} is not a readable {found.lower()} ({_why(exc)})"
        ) from None
    check_pixels(image.size, limits, what=what)
    return image


def _why(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
