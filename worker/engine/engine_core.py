"""EngineCore: the public face of the engine (API of the reference ``vllm_mlx.engine_core``).

Callers on an asyncio loop add requests and stream their outputs; the MLX work happens on the
engine thread (``EngineLoop``). Requests are tokenized and validated here, in the caller, so
bad input is a ``ValueError`` to whoever sent it and never reaches the batch. Each engine step's
outputs cross back to the loop in one ``call_soon_threadsafe``; collectors merge what a slow
reader has not taken yet. Every request ends with exactly one final output, also on abort,
timeout, cancellation, stop and close.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import structlog

from worker.engine.config import EngineConfig, SchedulerConfig
from worker.engine.engine_loop import EngineLoop, EngineStoppedError
from worker.engine.fingerprint import model_fingerprint
from worker.engine.output_collector import RequestOutputCollector
from worker.engine.prefix_cache import IncompatibleCacheError
from worker.engine.prompt import encode_prompt
from worker.engine.registry import ModelOwnershipError, get_registry
from worker.engine.request import Request, RequestOutput, SamplingParams
from worker.engine.scheduler import QueueFullError, Scheduler, SchedulerOutput

log = structlog.get_logger(__name__)

T = TypeVar("T")


class _SyncBatch:
    """Final outputs for ``generate_batch_sync`` callers, filled by the engine thread."""

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


class EngineCore:
    """Core engine: continuous batching of many requests over one model."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: EngineConfig | None = None,
        engine_id: str | None = None,
        force_model_ownership: bool = True,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self._engine_id = engine_id or str(uuid.uuid4())
        self._owns_model = False
        self._closed = False
        self._revoked_by: str | None = None
        get_registry().acquire(model, self, self._engine_id, force=force_model_ownership)
        self._owns_model = True

        scheduler_config = self.config.scheduler_config or SchedulerConfig()
        self.scheduler = Scheduler(model=model, tokenizer=tokenizer, config=scheduler_config)
        self._engine_loop = EngineLoop(self.scheduler, self._on_engine_output, self.config)
        self._max_open = scheduler_config.max_num_seqs + scheduler_config.max_waiting_requests
        self._max_prompt_tokens = scheduler_config.max_prompt_tokens
        self._vocab_size = _vocab_size(model, tokenizer)
        self._output_collectors: dict[str, RequestOutputCollector] = {}
        self._request_loops: dict[str, asyncio.AbstractEventLoop] = {}
        self._sync_batches: dict[str, _SyncBatch] = {}
        self._step_listener: Callable[[list[RequestOutput]], None] | None = None
        self._running = False
        self._start_time: float | None = None
        self._fingerprint: str | None = None

    @property
    def engine_id(self) -> str:
        return self._engine_id

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._check_usable()
        if self._running:
            return
        self._start_engine_thread()
        self._running = True
        log.info("engine_started", engine_id=self._engine_id)

    async def stop(self) -> None:
        """Stop the engine loop; every open request gets a final ``abort`` output."""
        self._running = False
        await asyncio.to_thread(self._engine_loop.stop)
        await asyncio.sleep(0)  # let the final outputs reach their collectors
        log.info("engine_stopped", engine_id=self._engine_id)

    def is_running(self) -> bool:
        return self._running and self._engine_loop.is_alive()

    def close(self) -> None:
        """Finish open requests, free caches and release the model. Idempotent."""
        if self._closed:
            return
        if self._engine_loop.is_alive():
            with contextlib.suppress(EngineStoppedError):
                self._engine_loop.call_sync(lambda s: s.clear_prefix_cache())
        self._engine_loop.stop()
        self._running = False
        self.scheduler.prefix_cache = None
        self._release_model()
        self._closed = True
        log.debug("engine_closed", engine_id=self._engine_id)

    def _release_model(self) -> None:
        if self._owns_model:
            get_registry().release(self.model, self._engine_id)
            self._owns_model = False

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._release_model()

    def _on_ownership_revoked(self, new_engine_id: str) -> None:
        self._revoked_by = new_engine_id
        self._owns_model = False
        self._running = False
        message = f"model ownership was taken by engine {new_engine_id}"
        self._engine_loop.stop(reason="error", message=message, wait=False)
        log.warning("engine_ownership_revoked", engine_id=self._engine_id, new_owner=new_engine_id)

    def _check_usable(self) -> None:
        if self._revoked_by is not None:
            raise ModelOwnershipError(
                f"engine {self._engine_id} no longer owns its model (taken by engine "
                f"{self._revoked_by}); create a new engine"
            )
        if self._closed:
            raise RuntimeError(f"engine {self._engine_id} is closed")

    def _start_engine_thread(self) -> None:
        self._engine_loop.start()
        if self._start_time is None:
            self._start_time = time.time()

    # -- requests ----------------------------------------------------------------------------

    async def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        images: list[Any] | None = None,
        videos: list[Any] | None = None,
        prefix_boundary: int = 0,
        *,
        stream_interval: int | None = None,
        collect: bool = True,
    ) -> str:
        """Queue a request and return its id. Raises ``ValueError`` for bad input,
        ``QueueFullError`` when the waiting queue is full.

        ``collect=False`` skips the per-request collector: the outputs then reach only the
        step listener (see ``set_step_listener``), and ``stream_outputs`` has nothing to read.
        """
        request = self._make_request(
            prompt, sampling_params, request_id, images, videos, prefix_boundary, stream_interval
        )
        if request.request_id in self._request_loops:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        if not self._running:
            await self.start()
        if collect:
            self._output_collectors[request.request_id] = RequestOutputCollector(aggregate=True)
        self._request_loops[request.request_id] = asyncio.get_running_loop()
        self._submit([request])
        return request.request_id

    async def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request; its stream ends with ``finish_reason="abort"``."""
        try:
            return await asyncio.wrap_future(
                self._engine_loop.call(lambda s: s.abort_request(request_id))
            )
        except EngineStoppedError:
            return False

    async def stream_outputs(
        self, request_id: str, timeout: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs as they are produced, ending with the final one.

        ``timeout`` bounds the wait for each output: when it passes, the request is aborted and
        its final ``abort`` output is yielded. A caller that stops iterating or is cancelled
        aborts the request.
        """
        collector = self._output_collectors.get(request_id)
        if collector is None:
            log.warning("stream_outputs_unknown_request", request_id=request_id)
            return
        finished = False
        try:
            while not finished:
                output = collector.get_nowait()
                if output is None:
                    try:
                        output = await asyncio.wait_for(collector.get(), timeout)
                    except TimeoutError:
                        log.warning("stream_outputs_timeout", request_id=request_id)
                        output = await self._abort_and_collect(request_id, collector)
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._abort_in_background(request_id)
            self._forget(request_id)

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> RequestOutput:
        """Run a request to completion; the result's ``new_text`` holds the whole text."""
        request_id = await self.add_request(
            prompt, sampling_params=sampling_params, request_id=request_id, **kwargs
        )
        final: RequestOutput | None = None
        async for output in self.stream_outputs(request_id):
            final = output if final is None else output.merged_after(final)
        if final is None:
            raise RuntimeError(f"no output for request {request_id}")
        return final

    def generate_batch_sync(
        self,
        prompts: list[str | list[int]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Generate for all prompts at once and block until done; results in prompt order.

        Blocking: do not call it from an event loop that is serving streamed requests.
        """
        params = sampling_params or SamplingParams()
        requests = [
            self._make_request(p, params, None, None, None, 0, params.max_tokens + 1)
            for p in prompts
        ]
        if not requests:
            return []
        self._start_engine_thread()
        batch = _SyncBatch([r.request_id for r in requests])
        for request in requests:
            self._sync_batches[request.request_id] = batch
        try:
            self._submit(requests)
            batch.done.wait()
        finally:
            for request in requests:
                self._sync_batches.pop(request.request_id, None)
        return [batch.outputs[r.request_id] for r in requests]

    # -- stats and caches --------------------------------------------------------------------

    def get_stats(self) -> dict[str, Any]:
        uptime = time.time() - self._start_time if self._start_time else 0.0
        return {
            "engine_id": self._engine_id,
            "model_name": self.config.model_name,
            "running": self.is_running(),
            "uptime_seconds": uptime,
            "steps_executed": self._engine_loop.steps_executed,
            "engine_thread_cpu_seconds": self._engine_loop.cpu_seconds(),
            # Of step_seconds, model_seconds (below) went to mlx-lm's BatchGenerator; the rest
            # is the engine's own per-step and per-token host work.
            "step_seconds": self._engine_loop.step_seconds,
            "active_requests": len(self._request_loops) + len(self._sync_batches),
            "stream_interval": self.config.stream_interval,
            "requests": self.scheduler.get_running_requests_info(),
            "health": self._engine_loop.health(),
            **self.scheduler.get_stats(),
        }

    def get_cache_stats(self) -> dict[str, Any] | None:
        return self.scheduler.get_cache_stats()

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
        """Run the prefix cache's save or load on the engine thread; the entry count, or None
        when there is no prefix cache or the operation failed (logged). A load this model must
        not make raises ``IncompatibleCacheError``."""
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

    def clear_runtime_caches(self) -> dict[str, Any] | None:
        """Drop the prefix cache and MLX's buffer cache; returns what was freed."""

        def clear(scheduler: Scheduler) -> dict[str, Any]:
            import mlx.core as mx

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

    # -- internals ---------------------------------------------------------------------------

    def _on_engine(self, fn: Callable[[Scheduler], T]) -> T:
        self._check_usable()
        self._start_engine_thread()
        return self._engine_loop.call_sync(fn)

    def _model_fingerprint(self) -> str:
        if self._fingerprint is None:  # engine thread: reads parameter values
            self._fingerprint = model_fingerprint(self.model, self.tokenizer)
        return self._fingerprint

    def _make_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None,
        request_id: str | None,
        images: list[Any] | None,
        videos: list[Any] | None,
        prefix_boundary: int,
        stream_interval: int | None,
    ) -> Request:
        self._check_usable()
        if images or videos:
            raise ValueError("images/videos were given, but this engine serves a text-only model")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError("request_id must be a non-empty string")
        params = sampling_params if sampling_params is not None else SamplingParams()
        token_ids = self._tokenize(prompt)
        if not 0 <= prefix_boundary <= len(token_ids):
            raise ValueError(
                f"prefix_boundary {prefix_boundary} is not in [0, {len(token_ids)}] "
                "(the prompt's tokens)"
            )
        interval = self.config.stream_interval if stream_interval is None else stream_interval
        if not isinstance(interval, int) or interval < 1:
            raise ValueError("stream_interval must be an integer >= 1")
        if len(self._request_loops) + len(self._sync_batches) >= self._max_open:
            raise QueueFullError(f"engine is full ({self._max_open} open requests); retry later")
        return Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt=prompt,
            sampling_params=params,
            prompt_token_ids=token_ids,
            prefix_boundary=prefix_boundary,
            stream_interval=interval,
        )

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = encode_prompt(self.tokenizer, prompt)
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            token_ids = list(prompt)
            bad = [t for t in token_ids if not 0 <= t < self._vocab_size]
            if bad:
                raise ValueError(f"token ids out of range [0, {self._vocab_size}): {bad[:5]}")
        else:
            raise ValueError("prompt must be a string or a list of integer token ids")
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) > self._max_prompt_tokens:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, over the limit of {self._max_prompt_tokens}"
            )
        return token_ids

    def _submit(self, requests: list[Request]) -> None:
        def add_all(scheduler: Scheduler) -> None:
            for request in requests:
                try:
                    scheduler.add_request(request)
                except Exception as exc:
                    scheduler.reject(request, f"{type(exc).__name__}: {exc}")

        future = self._engine_loop.call(add_all)
        if future.done() and future.exception() is not None:
            for request in requests:
                self._forget(request.request_id)
            raise RuntimeError(str(future.exception()))

    def _on_engine_output(self, output: SchedulerOutput) -> None:
        """Engine thread: route one step's outputs, one loop wake-up per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[RequestOutput]] = {}
        for item in output.outputs:
            batch = self._sync_batches.get(item.request_id)
            if batch is not None:
                batch.put(item)
                continue
            loop = self._request_loops.get(item.request_id)
            if loop is not None:
                by_loop.setdefault(loop, []).append(item)
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is waiting
                loop.call_soon_threadsafe(self._distribute, items)

    def set_step_listener(self, listener: Callable[[list[RequestOutput]], None] | None) -> None:
        """Call ``listener`` on the event loop with all streamed outputs of each engine step.

        One call per step (not per request) lets a caller batch its own I/O per step.
        Exceptions it raises are logged and do not reach the engine.
        """
        self._step_listener = listener

    def _distribute(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            collector = self._output_collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)
            elif output.finished:  # nobody streams it: its bookkeeping ends here
                self._request_loops.pop(output.request_id, None)
        listener = self._step_listener
        if listener is not None:
            try:
                listener(outputs)
            except Exception:
                log.exception("step_listener_failed")

    async def _abort_and_collect(
        self, request_id: str, collector: RequestOutputCollector
    ) -> RequestOutput:
        """Abort and wait for the final output; synthesize it if the engine is gone."""
        if await self.abort_request(request_id):
            output = await collector.get()
            while not output.finished:
                output = (await collector.get()).merged_after(output)
            return output
        pending = collector.get_nowait()
        if pending is not None:
            return pending
        return RequestOutput(request_id=request_id, finished=True, finish_reason="abort")

    def _abort_in_background(self, request_id: str) -> None:
        self._engine_loop.call(lambda s: s.abort_request(request_id))

    def _forget(self, request_id: str) -> None:
        collector = self._output_collectors.pop(request_id, None)
        if collector is not None:
            collector.clear()
        self._request_loops.pop(request_id, None)


class AsyncEngineCore:
    """Async context manager around ``EngineCore``::

    async with AsyncEngineCore(model, tokenizer) as engine:
        request_id = await engine.add_request("Hello")
        async for output in engine.stream_outputs(request_id):
            print(output.new_text, end="")
    """

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig | None = None) -> None:
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


def _vocab_size(model: Any, tokenizer: Any) -> int:
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    return len(tokenizer.get_vocab())
