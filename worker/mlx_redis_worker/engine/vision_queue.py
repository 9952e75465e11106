"""Admitted image requests waiting for their vision encoding, a step's budget at a time.

The scheduler admits an image request like any other (a decode slot, its prefix-cache hit),
then parks it here unless the hit already covers its images. Each step encodes the requests at
the head (the vision tower over their images, merged into their prompts' embeddings) up to a
budget of image tokens, at least one request; each then joins the prefill like a text prompt.
The budget bounds what any step spends on vision, so the running batch decodes every step
whatever image work arrives; a parked request can be aborted like any other (it frees its slot
at once). Engine thread only.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_redis_worker.engine.stats import VisionStats
from mlx_redis_worker.engine.vision import VisionModel, prompt_embeddings


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

    def park(self, sequence: Any, admission: Any) -> None:
        """``sequence`` (admitted, with its prefix-cache ``admission``) waits for encoding."""
        self._parked.append((sequence, admission))

    def discard(self, sequence: Any) -> bool:
        """Drop a parked sequence (it finished: an abort, a stop); False when not parked."""
        for item in self._parked:
            if item[0] is sequence:
                self._parked.remove(item)
                return True
        return False

    def encode(self, budget: int) -> list[Encoded]:
        """Encode parked requests in order while their image tokens stay within ``budget``
        (the first always: a request larger than the budget takes a step of its own)."""
        encoded: list[Encoded] = []
        while self._parked:
            tokens = self._parked[0][0].request.vision.image_tokens
            if encoded and tokens > budget:
                break
            budget -= tokens
            encoded.append(self._encode_next())
        return encoded

    def _encode_next(self) -> Encoded:
        sequence, admission = self._parked.popleft()
        started = time.perf_counter()
        prompt = sequence.request.vision
        start = admission.cached_tokens
        try:
            embeddings = prompt_embeddings(self.vision, prompt, start)
        except Exception as exc:  # a request's images the model cannot take: its failure
            return Encoded(sequence, admission, start, error=exc)
        finally:
            self.encode_seconds += time.perf_counter() - started
        sequence.request.vision = prompt.encoded()
        self.requests_encoded += 1
        self.images_encoded += prompt.num_images
        self.image_tokens_encoded += prompt.image_tokens
        return Encoded(sequence, admission, start, embeddings)
