"""Reference-only API: what ``vllm_mlx.engine_core`` offers beyond the path a request takes.

Callers written against the reference keep working with it; the daemon needs none of it (the
benches and tests use ``generate_batch_sync`` for its brevity). ``engine_core.py`` holds the
path itself and the typed stats.

- ``ReferenceApi``, mixed into ``EngineCore``: ``generate_batch_sync`` (a blocking batch, its
  final outputs handed over on the engine thread instead of through an event loop) and the
  ``get_stats()`` / ``get_cache_stats()`` dicts, built from ``stats()`` / ``cache_stats()``.
- ``AsyncEngineCore``: an async context manager around an ``EngineCore``.
- ``add_request``'s ``images`` / ``videos`` parameters stay in its signature; this text-only
  engine refuses them with a ``ValueError``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from mlx_redis_worker.engine.config import EngineConfig
from mlx_redis_worker.engine.request import Request, RequestOutput, SamplingParams
from mlx_redis_worker.engine.stats import EngineStats, PrefixCacheStats


class SyncBatch:
    """Final outputs of one ``generate_batch_sync`` call, filled by the engine thread."""

    def __init__(self, request_ids: list[str]) -> None:
        self.outputs: dict[str, RequestOutput] = {}
        self.remaining = set(request_ids)
        self.done = threading.Event()

    def put(self, output: RequestOutput) -> None:
        earlier = self.outputs.get(output.request_id)
        self.outputs[output.request_id] = output.merged_after(earlier) if earlier else output
        if output.finished:
            self.remaining.discard(output.request_id)
            if not self.remaining:
                self.done.set()


class ReferenceApi:
    """The reference's blocking batch and stats dicts; mixed into ``EngineCore``."""

    # What they need of the EngineCore they are mixed into. Requests of generate_batch_sync
    # calls in flight are in _sync_batches: EngineCore routes their outputs there.
    _sync_batches: dict[str, SyncBatch]
    _check_usable: Callable[[], None]
    _start_engine_thread: Callable[[], None]
    _make_request: Callable[
        [str | list[int], SamplingParams | None, str | None, int, int | None], Request
    ]
    _submit: Callable[[list[Request]], None]
    stats: Callable[[], EngineStats]
    cache_stats: Callable[[], PrefixCacheStats | None]

    def generate_batch_sync(
        self,
        prompts: list[str | list[int]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Generate for all prompts at once and block until done; results in prompt order,
        each with the whole text in ``new_text``.

        Blocking: do not call it from an event loop that is serving streamed requests.
        """
        if not prompts:
            return []
        self._check_usable()
        params = sampling_params or SamplingParams()
        # One output per request (its final one): nothing streams.
        requests = [self._make_request(p, params, None, 0, params.max_tokens + 1) for p in prompts]
        self._start_engine_thread()
        batch = SyncBatch([r.request_id for r in requests])
        for request in requests:
            self._sync_batches[request.request_id] = batch
        try:
            self._submit(requests)
            batch.done.wait()
        finally:
            for request in requests:
                self._sync_batches.pop(request.request_id, None)
        return [batch.outputs[r.request_id] for r in requests]

    def get_stats(self) -> dict[str, Any]:
        """``stats()`` as the reference's flat dict."""
        return self.stats().as_dict()

    def get_cache_stats(self) -> dict[str, Any] | None:
        """``cache_stats()`` as a dict; None without a prefix cache."""
        stats = self.cache_stats()
        return stats.as_dict() if stats is not None else None


class AsyncEngineCore:
    """Async context manager around ``EngineCore``::

    async with AsyncEngineCore(model, tokenizer) as engine:
        request_id = await engine.add_request("Hello")
        async for output in engine.stream_outputs(request_id):
            print(output.new_text, end="")
    """

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig | None = None) -> None:
        from mlx_redis_worker.engine.engine_core import (
            EngineCore,  # engine_core imports this module
        )

        self.engine = EngineCore(model, tokenizer, config)
        self._start_task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncEngineCore:
        await self.engine.start()
        return self

    async def __aexit__(self, *args: object) -> None:
        await self.engine.stop()

    def start(self) -> None:
        """Start the engine (creates a task in the current loop)."""
        self._start_task = asyncio.create_task(self.engine.start())

    async def stop(self) -> None:
        await self.engine.stop()

    async def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> str:
        return await self.engine.add_request(
            prompt=prompt, sampling_params=sampling_params, request_id=request_id, **kwargs
        )

    async def abort_request(self, request_id: str) -> bool:
        return await self.engine.abort_request(request_id)

    async def stream_outputs(
        self, request_id: str, timeout: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        async for output in self.engine.stream_outputs(request_id, timeout=timeout):
            yield output

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> RequestOutput:
        return await self.engine.generate(prompt=prompt, sampling_params=sampling_params, **kwargs)

    def get_stats(self) -> dict[str, Any]:
        return self.engine.get_stats()

    def get_cache_stats(self) -> dict[str, Any] | None:
        return self.engine.get_cache_stats()

    def save_cache_to_disk(self, cache_dir: str) -> bool:
        return self.engine.save_cache_to_disk(cache_dir)

    def load_cache_from_disk(self, cache_dir: str) -> int:
        return self.engine.load_cache_from_disk(cache_dir)

    def clear_runtime_caches(self) -> dict[str, Any] | None:
        return self.engine.clear_runtime_caches()
