"""Admitted image requests waiting for their vision encoding, a step's budget at a time.

The scheduler admits an image request like any other (a decode slot, its prefix-cache hit),
then parks it here unless the hit already covers its images. Each step runs the vision tower
on the tiles of the requests at the head (the processor's sub-images of each picture, and the
picture whole) up to a budget of image tokens, one tile at least, so a page of many tiles
spans steps and no step carries more vision work than its budget and one tile; a request whose
tiles are done has its features merged into its prompt's embeddings and joins the prefill
like a text prompt. The running batch decodes every step whatever image work arrives; a
parked request can be aborted like any other, part-way through its tiles too (it frees its
slot at once). Engine thread only.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_redis_worker.engine.stats import VisionStats
from mlx_redis_worker.engine.vision import (
    VisionModel,
    VisionPrompt,
    prompt_embeddings,
    tile_features,
)


@dataclass(slots=True)
class Encoded:
    """A request whose images were encoded: ``embeddings`` are its prompt's input embeddings
    from position ``start`` (where its prefix-cache hit ends) on; or ``error``, what failed
    (that request's alone: the queue goes on)."""

    sequence: Any
    admission: Any
    start: int
    embeddings: mx.array | None = None
    error: Exception | None = None


class VisionQueue:
    def __init__(self, vision: VisionModel) -> None:
        self.vision = vision
        self._parked: deque[tuple[Any, Any]] = deque()
        # The request at the head, part-way: its tiles' features so far.
        self._features: list[mx.array] = []
        self._tiles_done = 0
        self.requests_encoded = 0
        self.images_encoded = 0
        self.image_tokens_encoded = 0
        self.encode_seconds = 0.0

    def __len__(self) -> int:
        return len(self._parked)

    def stats(self) -> VisionStats:
        return VisionStats(
            waiting_for_encoding=len(self._parked),
            requests_encoded=self.requests_encoded,
            images_encoded=self.images_encoded,
            image_tokens_encoded=self.image_tokens_encoded,
            encode_seconds=self.encode_seconds,
        )

    def head(self) -> tuple[str, int, int] | None:
        """The request being encoded next: its id, its tiles done and its tiles."""
        if not self._parked:
            return None
        request = self._parked[0][0].request
        return request.request_id, self._tiles_done, request.vision.tiles

    def park(self, sequence: Any, admission: Any) -> None:
        """``sequence`` (admitted, with its prefix-cache ``admission``) waits for encoding."""
        self._parked.append((sequence, admission))

    def discard(self, sequence: Any) -> bool:
        """Drop a parked sequence (it finished: an abort, a stop); False when not parked."""
        for index, item in enumerate(self._parked):
            if item[0] is sequence:
                if index == 0:
                    self._restart_head()
                del self._parked[index]
                return True
        return False

    def encode(self, budget: int) -> list[Encoded]:
        """Run the vision tower on parked requests' tiles, in order, while their image tokens
        stay within ``budget`` (one tile at least: the work a step can always make), and merge
        each request whose tiles are all done. A request's tiles may span steps."""
        encoded: list[Encoded] = []
        spent = 0
        while self._parked:
            sequence, admission = self._parked[0]
            prompt = sequence.request.vision
            take = min(prompt.tiles - self._tiles_done, (budget - spent) // prompt.tile_tokens)
            if take <= 0:
                if spent:
                    break
                take = 1
            started = time.perf_counter()
            try:
                done = self._encode_tiles(prompt, take)
                result = self._merge(sequence, admission) if done else None
            except Exception as exc:  # a request's images the model cannot take: its failure
                self._parked.popleft()
                self._restart_head()
                result = Encoded(sequence, admission, admission.cached_tokens, error=exc)
            finally:
                self.encode_seconds += time.perf_counter() - started
            spent += take * prompt.tile_tokens
            if result is None:
                break  # the budget ran out part-way through this request
            encoded.append(result)
        return encoded

    def _encode_tiles(self, prompt: VisionPrompt, count: int) -> bool:
        """The next ``count`` tiles of the head request; True once all of them are done."""
        if prompt.tiles > 1:
            self._features.append(tile_features(self.vision, prompt, self._tiles_done, count))
        self._tiles_done += count
        self.image_tokens_encoded += count * prompt.tile_tokens
        return self._tiles_done >= prompt.tiles

    def _merge(self, sequence: Any, admission: Any) -> Encoded:
        """The head request's embeddings, its tiles' features merged in (the tower runs here
        for a request of one tile)."""
        prompt = sequence.request.vision
        features = mx.concatenate(self._features) if self._features else None
        start = admission.cached_tokens
        embeddings = prompt_embeddings(self.vision, prompt, start, features)
        self._parked.popleft()
        self._restart_head()
        sequence.request.vision = prompt.encoded()
        self.requests_encoded += 1
        self.images_encoded += prompt.num_images
        return Encoded(sequence, admission, start, embeddings)

    def _restart_head(self) -> None:
        self._features = []
        self._tiles_done = 0
