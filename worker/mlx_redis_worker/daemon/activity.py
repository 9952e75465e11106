"""What the worker is doing now, for dashboards: tokens per time bucket over the last minutes.

The publisher counts every streamed token here (the event loop's side of a step, no MLX); the
serving loop writes the snapshot to ``mlxw:activity:{worker_id}``
(protocol/mlx_redis_protocol/activity.py).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Final

BUCKET_SECONDS: Final = 2
HISTORY_SECONDS: Final = 300


class TokenHistory:
    """Tokens generated per epoch-aligned bucket, for the last ``history_seconds``."""

    def __init__(
        self, bucket_seconds: int = BUCKET_SECONDS, history_seconds: int = HISTORY_SECONDS
    ) -> None:
        if bucket_seconds < 1 or history_seconds < bucket_seconds:
            raise ValueError("need bucket_seconds >= 1 and history_seconds >= bucket_seconds")
        self.bucket_seconds = bucket_seconds
        self._kept = history_seconds // bucket_seconds
        self._buckets: deque[list[int]] = deque()  # [start, tokens], oldest first

    def add(self, tokens: int, now: float | None = None) -> None:
        if tokens <= 0:
            return
        start = self._start(time.time() if now is None else now)
        if self._buckets and self._buckets[-1][0] == start:
            self._buckets[-1][1] += tokens
        else:
            self._buckets.append([start, tokens])
        self._trim(start)

    def buckets(self, now: float | None = None) -> tuple[tuple[int, int], ...]:
        """The non-empty buckets of the window ending now, oldest first."""
        self._trim(self._start(time.time() if now is None else now))
        return tuple((start, tokens) for start, tokens in self._buckets)

    def _start(self, now: float) -> int:
        return int(now // self.bucket_seconds) * self.bucket_seconds

    def _trim(self, current: int) -> None:
        oldest = current - (self._kept - 1) * self.bucket_seconds
        while self._buckets and self._buckets[0][0] < oldest:
            self._buckets.popleft()
