"""The prefix cache's save, load and clear, mixed into ``EngineCore``.

Each runs on the engine thread (which it starts if need be) and blocks its caller until done:
call them off the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import mlx.core as mx
import structlog

from mlx_redis_worker.engine.engine_thread import EngineThread
from mlx_redis_worker.engine.errors import IncompatibleCacheError
from mlx_redis_worker.engine.fingerprint import model_fingerprint
from mlx_redis_worker.engine.scheduler import Scheduler

log = structlog.get_logger(__name__)

T = TypeVar("T")


class CacheControl:
    """``EngineCore``'s prefix-cache operations (reference API names)."""

    # What they need of the EngineCore they are mixed into.
    model: Any
    tokenizer: Any
    scheduler: Scheduler
    _engine_thread: EngineThread[Scheduler]
    _fingerprint: str | None  # the model's, for saved caches; made on first use
    _check_usable: Callable[[], None]
    _start_engine_thread: Callable[[], None]

    def save_cache_to_disk(self, cache_dir: str) -> bool:
        """Write the prefix cache to ``cache_dir`` atomically, tagged with the model's identity."""
        return self._disk_cache_op("save", cache_dir) is not None

    def load_cache_from_disk(self, cache_dir: str) -> int:
        """Load a saved prefix cache; returns the number of entries added (0 when refused)."""
        try:
            return self.load_cache_checked(cache_dir)
        except IncompatibleCacheError as exc:
            log.warning("prefix_cache_load_refused", directory=cache_dir, reason=exc.reason)
            return 0

    def load_cache_checked(self, cache_dir: str) -> int:
        """``load_cache_from_disk`` for callers that must tell a refusal from an empty cache:
        a cache saved by another model, in another format or unreadable raises
        ``IncompatibleCacheError`` (which says why) instead of counting 0."""
        return self._disk_cache_op("load", cache_dir) or 0

    def _disk_cache_op(self, operation: str, cache_dir: str) -> int | None:
        """The prefix cache's save or load; the entry count, or None when there is no prefix
        cache or the operation failed (logged). A load this model must not make raises
        ``IncompatibleCacheError``."""
        if self.scheduler.prefix_cache is None:
            return None

        def run(scheduler: Scheduler) -> int | None:
            cache = scheduler.prefix_cache
            if cache is None:
                return None
            method = cache.save if operation == "save" else cache.load
            return method(cache_dir, self._model_fingerprint())

        try:
            count = self._on_engine(run)
        except IncompatibleCacheError:
            raise  # the caller's answer, not an engine failure
        except Exception as exc:
            log.error(f"prefix_cache_{operation}_failed", directory=cache_dir, error=str(exc))
            return None
        log.info(f"prefix_cache_{operation}", directory=cache_dir, entries=count)
        return count

    def _model_fingerprint(self) -> str:
        if self._fingerprint is None:  # engine thread: reads parameter values
            self._fingerprint = model_fingerprint(self.model, self.tokenizer)
        return self._fingerprint

    def clear_runtime_caches(self) -> dict[str, Any] | None:
        """Drop the prefix cache and MLX's buffer cache; returns what was freed."""

        def clear(scheduler: Scheduler) -> dict[str, Any]:
            buffers = int(mx.get_cache_memory())
            prefix = scheduler.clear_prefix_cache()
            mx.clear_cache()
            return {
                "prefix_cache_entries": prefix["entries"],
                "prefix_cache_bytes": prefix["bytes"],
                "mlx_buffer_cache_bytes": buffers,
            }

        return self._on_engine(clear)

    def clear_prefix_cache(self) -> None:
        self._on_engine(lambda s: s.clear_prefix_cache())

    def _on_engine(self, fn: Callable[[Scheduler], T]) -> T:
        self._check_usable()
        self._start_engine_thread()
        return self._engine_thread.call_sync(fn)
