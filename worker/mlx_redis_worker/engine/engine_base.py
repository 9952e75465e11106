"""The path of a request through an engine, whatever kind of model it serves.

``EngineBase`` holds what every engine shares: the model's ownership, the engine thread (the
one thread that touches MLX; ``EngineThread``) stepping a scheduler, and the way each step's
outputs reach their callers. A kind of engine is a subclass that makes its scheduler and its
requests: ``EngineCore`` generates text (``scheduler.Scheduler`` over mlx-lm's batch
generator), ``EmbeddingEngineCore`` embeds inputs (``embedding_scheduler``). Both run the one
step loop, and their outputs take the one way out, in the order of this file:

1. A subclass checks a request in the caller (bad input is a ``ValueError`` there and never
   reaches the batch), ``_open``s it and ``_submit``s it to the engine thread, whose
   scheduler batches it with the others.
2. The engine thread calls ``_on_engine_output`` with each step's outputs; they cross to the
   request's event loop in one ``call_soon_threadsafe`` per step, where ``_distribute`` puts
   each in its request's collector and hands the whole step to the step listener.
3. ``stream_outputs`` reads the collector (which merges what a slow reader has not taken yet)
   up to the final output; ``abort_request`` ends a request early.
4. ``stop()`` ends the engine thread; ``close()`` also frees what the scheduler holds and
   the model.

Every request ends with exactly one final output, also on abort, timeout, cancellation, stop
and close.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar, Generic

import structlog

from mlx_redis_worker.engine.config import EngineConfig, SchedulerConfig
from mlx_redis_worker.engine.engine_thread import EngineThread, S
from mlx_redis_worker.engine.errors import EngineStoppedError, QueueFullError
from mlx_redis_worker.engine.output_collector import RequestOutputCollector
from mlx_redis_worker.engine.reference_api import SyncBatch
from mlx_redis_worker.engine.registry import ModelOwnershipError, get_registry
from mlx_redis_worker.engine.request import RequestOutput
from mlx_redis_worker.engine.scheduler import SchedulerOutput
from mlx_redis_worker.engine.stats import (
    EngineStats,
    MlxMemory,
    PrefixCacheStats,
    RequestProgress,
    SchedulerStats,
    read_mlx_memory,
)

log = structlog.get_logger(__name__)


class EngineBase(Generic[S]):
    """An engine over one model: its scheduler ``S`` stepped by the engine thread."""

    # Whether the engine embeds (``add_embedding_request``) rather than generates.
    makes_embeddings: ClassVar[bool] = False

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
        self.scheduler: S = self._build_scheduler(scheduler_config)
        self._engine_thread: EngineThread[S] = EngineThread(
            self.scheduler, self._on_engine_output, self.config
        )
        self._max_open = scheduler_config.max_num_seqs + scheduler_config.max_waiting_requests
        # Where an open request's outputs go: its caller's event loop (``_open``), or the
        # blocking batch it is part of (generate_batch_sync, reference_api.py).
        self._request_loops: dict[str, asyncio.AbstractEventLoop] = {}
        self._sync_batches: dict[str, SyncBatch] = {}
        self._output_collectors: dict[str, RequestOutputCollector] = {}
        self._step_listener: Callable[[list[RequestOutput]], None] | None = None
        self._running = False
        self._start_time: float | None = None

    def _build_scheduler(self, scheduler_config: SchedulerConfig) -> S:
        """The scheduler of this kind of engine (called once, after taking the model)."""
        raise NotImplementedError

    @property
    def engine_id(self) -> str:
        return self._engine_id

    async def start(self) -> None:
        self._check_usable()
        if self._running:
            return
        self._start_engine_thread()
        self._running = True
        log.info("engine_started", engine_id=self._engine_id)

    def is_running(self) -> bool:
        return self._running and self._engine_thread.is_alive()

    # -- a request's way in ------------------------------------------------------------------

    def _check_room(self) -> None:
        """``QueueFullError`` when the engine holds as many open requests as it may."""
        if len(self._request_loops) + len(self._sync_batches) >= self._max_open:
            raise QueueFullError(f"engine is full ({self._max_open} open requests); retry later")

    async def _open(self, request: Any, *, collect: bool) -> str:
        """Register a checked request (it has a ``request_id``) with its caller's loop and
        hand it to the engine thread; ``collect=False``: its outputs reach only the step
        listener."""
        request_id: str = request.request_id
        if request_id in self._request_loops:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        if not self._running:
            await self.start()
        self._register(request, collect=collect)
        self._submit([request])
        return request_id

    def _register(self, request: Any, *, collect: bool) -> None:
        """Event loop: make a checked request's way out (its loop, its collector when
        ``collect``); ``_submit`` then hands it to the engine thread."""
        request_id: str = request.request_id
        if request_id in self._request_loops:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        if collect:
            self._output_collectors[request_id] = RequestOutputCollector(aggregate=True)
        self._request_loops[request_id] = asyncio.get_running_loop()

    def _submit(self, requests: list[Any]) -> None:
        """Hand requests to the scheduler on the engine thread; one it refuses (a full queue)
        ends at once with a final ``error`` output."""

        def add_all(scheduler: S) -> None:
            for request in requests:
                try:
                    scheduler.add_request(request)
                except Exception as exc:
                    scheduler.reject(request, f"{type(exc).__name__}: {exc}")

        future = self._engine_thread.call(add_all)
        if future.done() and future.exception() is not None:
            for request in requests:
                self._forget(request.request_id)
            raise RuntimeError(str(future.exception()))

    # -- a step's outputs on their way out ---------------------------------------------------

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

    def _distribute(self, outputs: list[RequestOutput]) -> None:
        """Event loop: each output to its request's collector, the step to the listener."""
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

    def set_step_listener(self, listener: Callable[[list[RequestOutput]], None] | None) -> None:
        """Call ``listener`` on the event loop with all streamed outputs of each engine step.

        One call per step (not per request) lets a caller batch its own I/O per step.
        Exceptions it raises are logged and do not reach the engine.
        """
        self._step_listener = listener

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

    def _forget(self, request_id: str) -> None:
        collector = self._output_collectors.pop(request_id, None)
        if collector is not None:
            collector.clear()
        self._request_loops.pop(request_id, None)

    # -- ending requests, and the engine -----------------------------------------------------

    async def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request; its stream ends with ``finish_reason="abort"``."""
        try:
            return await asyncio.wrap_future(
                self._engine_thread.call(lambda s: s.abort_request(request_id))
            )
        except EngineStoppedError:
            return False

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
        self._engine_thread.call(lambda s: s.abort_request(request_id))

    async def stop(self) -> None:
        """Stop the engine loop; every open request gets a final ``abort`` output."""
        self._running = False
        await asyncio.to_thread(self._engine_thread.stop)
        await asyncio.sleep(0)  # let the final outputs reach their collectors
        log.info("engine_stopped", engine_id=self._engine_id)

    def close(self) -> None:
        """Finish open requests, free what the scheduler holds and release the model.
        Idempotent."""
        if self._closed:
            return
        if self._engine_thread.is_alive():
            with contextlib.suppress(EngineStoppedError):
                self._engine_thread.call_sync(self._free_on_engine_thread)
        self._engine_thread.stop()
        self._running = False
        self._free_scheduler()
        self._release_model()
        self._closed = True
        log.debug("engine_closed", engine_id=self._engine_id)

    def _free_on_engine_thread(self, scheduler: S) -> None:
        """What a closing engine frees on its engine thread, before that thread ends."""

    def _free_scheduler(self) -> None:
        """What a closed engine frees of its scheduler, once the engine thread has ended."""

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
        self._engine_thread.stop(reason="error", message=message, wait=False)
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
        self._engine_thread.start()
        if self._start_time is None:
            self._start_time = time.time()

    # -- stats -------------------------------------------------------------------------------

    def _scheduler_stats(self) -> tuple[SchedulerStats, tuple[RequestProgress, ...]]:
        """The scheduler's counters and its open requests (any thread)."""
        raise NotImplementedError

    def stats(self) -> EngineStats:
        """The engine's counters now (any thread: the scheduler's are read as they stand)."""
        scheduler, requests = self._scheduler_stats()
        return EngineStats(
            engine_id=self._engine_id,
            model_name=self.config.model_name,
            running=self.is_running(),
            uptime_seconds=time.time() - self._start_time if self._start_time else 0.0,
            steps_executed=self._engine_thread.steps_executed,
            engine_thread_cpu_seconds=self._engine_thread.cpu_seconds(),
            step_seconds=self._engine_thread.step_seconds,
            active_requests=len(self._request_loops) + len(self._sync_batches),
            stream_interval=self.config.stream_interval,
            requests=requests,
            health=self._engine_thread.health(),
            scheduler=scheduler,
        )

    def cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's counters; None when there is none."""
        return None

    def memory_stats(self, timeout: float) -> MlxMemory:
        """MLX's allocator figures, read on the engine thread between two steps. Raises
        ``EngineStoppedError`` when that thread is not running and ``TimeoutError`` when a step
        (a long prefill) holds it past ``timeout`` seconds. Blocking: call it off the loop."""
        return self._engine_thread.call_sync(lambda _: read_mlx_memory(), timeout)

    async def memory_stats_async(self, timeout: float) -> MlxMemory:
        """``memory_stats`` from the event loop: awaits the engine thread's answer instead of
        holding a thread of the loop's pool while it comes (a process of many workers,
        answering a stats broadcast, would queue one each). The same errors; on a timeout the
        question is withdrawn, not left for the engine thread."""
        asked = self._engine_thread.call(lambda _: read_mlx_memory())
        return await asyncio.wait_for(asyncio.wrap_future(asked), timeout)
