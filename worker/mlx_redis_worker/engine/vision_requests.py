"""An image request's way into ``EngineCore``, mixed into it: its images processed on the
engine's own threads (never the event loop, never the engine thread), the engine's image
capability, and an abort that arrives while the images are being processed.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mlx_redis_worker.engine.errors import ImagesNotSupportedError, QueueFullError
from mlx_redis_worker.engine.vision import (
    VisionModel,
    VisionPrompt,
    prepare_vision_prompt,
    vision_model_of,
)

# Threads that process requests' images (PIL and numpy work, mostly outside the GIL).
VISION_THREADS = 2


class VisionRequests:
    """``EngineCore``'s images: ``supports_images``, ``image_placeholder`` and the add path's
    processing."""

    # What they need of the EngineCore they are mixed into.
    _request_loops: dict[str, asyncio.AbstractEventLoop]
    _sync_batches: dict[str, Any]
    _max_open: int
    _vocab_size: int
    _max_prompt_tokens: int

    def _init_vision(self, model: Any) -> None:
        self._vision: VisionModel | None = vision_model_of(model)
        self._vision_pool: ThreadPoolExecutor | None = None
        # Requests whose images are being processed, by id: True once aborted meanwhile.
        self._preparing: dict[str, bool] = {}

    @property
    def supports_images(self) -> bool:
        """Whether this engine's model takes images and videos (a vision-language model)."""
        return self._vision is not None

    @property
    def supports_videos(self) -> bool:
        """Whether this engine's model takes videos: as ``supports_images`` (a video is its
        frames, each an image)."""
        return self._vision is not None

    @property
    def image_placeholder(self) -> str | None:
        """The text that marks an image's place in a prompt (None: a text-only model)."""
        return self._vision.image_placeholder if self._vision is not None else None

    async def _prepare_vision(
        self,
        prompt: str | list[int],
        images: list[Any] | None,
        videos: list[Any] | None,
        request_id: str | None,
    ) -> VisionPrompt:
        """The request's images processed on the vision threads (``ValueError`` for bad ones,
        ``ImagesNotSupportedError`` on a text model, ``QueueFullError`` when the engine is full:
        checked first, so a full engine processes nothing)."""
        vision = self._vision
        if vision is None:
            raise ImagesNotSupportedError(
                "images/videos were given, but this engine serves a text-only model"
            )
        if len(self._request_loops) + len(self._sync_batches) >= self._max_open:
            raise QueueFullError(f"engine is full ({self._max_open} open requests); retry later")
        known = isinstance(request_id, str) and bool(request_id)
        if known:
            self._preparing[str(request_id)] = False
        job = functools.partial(
            prepare_vision_prompt,
            vision,
            prompt,
            list(images or ()),
            [list(video) for video in videos or ()],
            vocab_size=self._vocab_size,
            max_tokens=self._max_prompt_tokens,
        )
        try:
            return await asyncio.get_running_loop().run_in_executor(self._vision_threads(), job)
        except BaseException:
            if known:
                self._preparing.pop(str(request_id), None)
            raise

    def _abort_while_preparing(self, request_id: str) -> bool:
        """Remember an abort of a request whose images are being processed: True if it is one."""
        if request_id not in self._preparing:
            return False
        self._preparing[request_id] = True
        return True

    def _aborted_while_prepared(self, request_id: str) -> bool:
        """Whether ``request_id`` (just added) was aborted while its images were processed."""
        return self._preparing.pop(request_id, False)

    def _vision_threads(self) -> ThreadPoolExecutor:
        if self._vision_pool is None:
            self._vision_pool = ThreadPoolExecutor(
                max_workers=VISION_THREADS, thread_name_prefix="mlxw-vision"
            )
        return self._vision_pool

    def _close_vision(self) -> None:
        if self._vision_pool is not None:
            self._vision_pool.shutdown(wait=False, cancel_futures=True)
            self._vision_pool = None
