"""OpenAI's image parts as a job's images: ``data:`` URLs decoded (bounded), ``http(s)`` URLs
fetched by the gateway from the hosts its operator allows, big files moved to blobs.

The gateway fetches, not the workers: it is the fleet's edge, the host with a way out to the
internet, where the workers need none (they sit beside Redis); a URL that cannot be fetched,
is too big or is no image is a 400 to the HTTP client at once, not an ``invalid_job`` after a
wait in the queue; and the file is fetched once, not again on every redelivery of the job.
What needs a decoder (pixels, corrupt files) is the worker's, which answers ``invalid_job``
(400 here when the answer is not streamed yet).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final

from mlx_redis_gateway.errors import ApiError, bad_request
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.identifiers import new_request_id
from mlx_redis_protocol.limits import Limits
from mlx_redis_protocol.media_fetch import FetchPolicy, fetch_media
from mlx_redis_protocol.media_formats import IMAGE_FORMATS, image_format
from mlx_redis_protocol.media_inputs import stage_media
from mlx_redis_protocol.messages import IMAGE_DETAILS, ContentPart, ImageInput, Job

# Chat's image part, and the Responses API's (whose ``image_url`` is the URL itself).
IMAGE_PART_TYPES: Final = ("image_url", "input_image")
# URL fetches one gateway runs at once (each on a thread); more wait their turn.
MAX_CONCURRENT_FETCHES: Final = 8


@dataclass
class ChatImages:
    """The images a chat's parts carried, in order, bounded as they are read."""

    limits: Limits
    images: list[ImageInput] = field(default_factory=list)
    inline_bytes: int = 0

    def add(self, part: Mapping[str, Any], param: str) -> ContentPart:
        """An image part read into the next image; its place in the turn."""
        if len(self.images) >= self.limits.max_images:
            raise bad_request(
                f"{param}: more than {self.limits.max_images} images",
                param=param,
                code="limit_exceeded",
            )
        url, detail = _url_and_detail(part, param)
        if url.startswith("data:"):
            data = data_url_bytes(url, param, self.limits)
            self.inline_bytes += len(data)
            if self.inline_bytes > self.limits.max_media_bytes:
                raise bad_request(
                    f"{param}: the images are over {self.limits.max_media_bytes} bytes",
                    param=param,
                    code="limit_exceeded",
                )
            self.images.append(ImageInput(data=data, detail=detail))
        elif url.lower().startswith(("http://", "https://")):
            self.images.append(ImageInput(url=url, detail=detail))
        else:
            raise bad_request(f"{param}: an image URL must be a data: or http(s) URL", param=param)
        return ContentPart("image")


def _url_and_detail(part: Mapping[str, Any], param: str) -> tuple[str, Any]:
    if part.get("type") == "image_url":
        inner = part.get("image_url")
        url = inner.get("url") if isinstance(inner, dict) else None
        detail = inner.get("detail") if isinstance(inner, dict) else None
    else:  # input_image: the Responses API's flat shape
        if part.get("file_id") is not None:
            raise bad_request(f"{param}: file_id images are not supported (no file store)", param)
        url, detail = part.get("image_url"), part.get("detail")
    if not isinstance(url, str) or not url:
        raise bad_request(f"{param}: an image part needs its URL", param=param)
    if detail is not None and detail not in IMAGE_DETAILS:
        raise bad_request(f"{param}: detail must be one of {', '.join(IMAGE_DETAILS)}", param)
    return url, detail


def data_url_bytes(url: str, param: str, limits: Limits) -> bytes:
    """The file in a ``data:[type];base64,…`` URL: its size bounded before it is decoded,
    its signature one of the allowed image formats."""
    head, comma, payload = url.partition(",")
    if not comma or not head.endswith(";base64"):
        raise bad_request(f"{param}: a data: URL must be base64 (data:image/png;base64,…)", param)
    # Three bytes per four characters: the size is known before anything is decoded.
    if len(payload) * 3 // 4 > limits.max_image_bytes + 2:
        raise bad_request(
            f"{param}: the image is over {limits.max_image_bytes} bytes",
            param=param,
            code="limit_exceeded",
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param}: the data: URL is not valid base64", param=param) from None
    if len(data) > limits.max_image_bytes:
        raise bad_request(
            f"{param}: the image is over {limits.max_image_bytes} bytes",
            param=param,
            code="limit_exceeded",
        )
    if image_format(data) is None:
        allowed = ", ".join(name.lower() for name in IMAGE_FORMATS)
        raise bad_request(f"{param}: not an image of an allowed format ({allowed})", param=param)
    return data


def staged_images(images: list[ImageInput], inline_bytes: int) -> tuple[Any, dict[str, bytes]]:
    """A chat's images with the big inline ones moved to blobs (ids only: the blobs are
    stored once the request is admitted), so the job stays within its message size."""
    staged = stage_media(images, (), inline_bytes)
    return staged.images, staged.blobs


class MediaResolver:
    """Before an admitted request with images is queued: its URLs fetched (allowed hosts
    only, each to a blob) and its blobs stored."""

    def __init__(self, policy: FetchPolicy, limits: Limits, store: Any) -> None:
        self.policy = policy
        self.limits = limits
        self.store = store  # Client.store_blob
        self._fetches = asyncio.Semaphore(MAX_CONCURRENT_FETCHES)

    async def resolve(self, job: Job, blobs: Mapping[str, bytes]) -> Job:
        """``job`` with every URL image fetched into a blob; every blob stored."""
        if not job.images:
            return job
        blobs = dict(blobs)
        images = []
        for index, image in enumerate(job.images):
            if image.url is not None:
                data = await self._fetch(image.url, index)
                blob = new_request_id()
                blobs[blob] = data
                image = ImageInput(blob=blob, detail=image.detail)
            images.append(image)
        inline = sum(len(image.data) for image in images if image.data is not None)
        if inline + sum(map(len, blobs.values())) > self.limits.max_media_bytes:
            raise bad_request(
                f"the images are over {self.limits.max_media_bytes} bytes",
                param="messages",
                code="limit_exceeded",
            )
        for blob_id, data in blobs.items():
            await self.store(blob_id, data)
        return replace(job, images=tuple(images))

    async def _fetch(self, url: str, index: int) -> bytes:
        what = f"image {index} ({url[:80]})"
        if not self.policy.enabled:
            raise bad_request(
                f"{what}: this gateway fetches no image URLs; send the image as a data: URL",
                param="messages",
            )
        try:
            async with self._fetches:
                data = await asyncio.to_thread(
                    fetch_media, url, self.policy, self.limits.max_image_bytes, what
                )
        except ProtocolError as exc:
            raise ApiError(400, exc.message, param="messages", code=exc.code) from None
        if image_format(data) is None:
            raise bad_request(f"{what} is not an image of an allowed format", param="messages")
        return data
