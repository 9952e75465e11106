"""EngineCore: the public face of the engine (API of the reference ``vllm_mlx.engine_core``).

The path of a request, in the order of this file:

1. ``EngineCore(model, tokenizer, config)`` takes the model (one engine per model) and builds
   the scheduler and the engine thread (``EngineThread``, the one thread that touches MLX);
   ``start()`` starts that thread (``add_request`` does too).
2. ``add_request`` tokenizes and checks the request here, in the caller, so bad input is a
   ``ValueError`` to whoever sent it and never reaches the batch; then hands it to the engine
   thread, whose scheduler batches it with the others.
3. The engine thread calls ``_on_engine_output`` with each step's outputs; they cross to the
   request's event loop in one ``call_soon_threadsafe`` per step, where ``_distribute`` puts
   each in its request's collector and hands the whole step to the step listener.
4. ``stream_outputs`` reads the collector (which merges what a slow reader has not taken yet)
   up to the final output; ``abort_request`` ends a request early.
5. ``stop()`` ends the engine thread; ``close()`` also frees the caches and the model.

Every request ends with exactly one final output, also on abort, timeout, cancellation, stop
and close. After the path: typed stats. The prefix cache's save, load and clear are in
cache_control.py; what only the reference API needs is in reference_api.py; an image
request's way in (its images processed off the loop) is in vision_requests.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog

from mlx_redis_worker.engine.cache_control import CacheControl
from mlx_redis_worker.engine.config import EngineConfig, SchedulerConfig
from mlx_redis_worker.engine.engine_thread import EngineStoppedError, EngineThread
from mlx_redis_worker.engine.output_collector import RequestOutputCollector
from mlx_redis_worker.engine.prompt import model_vocab_size, prompt_token_ids
from mlx_redis_worker.engine.reference_api import AsyncEngineCore, ReferenceApi, SyncBatch
from mlx_redis_worker.engine.registry import ModelOwnershipError, get_registry
from mlx_redis_worker.engine.request import Request, RequestOutput, SamplingParams
from mlx_redis_worker.engine.scheduler import QueueFullError, Scheduler, SchedulerOutput
from mlx_redis_worker.engine.speculative_batch import check_draft_model
from mlx_redis_worker.engine.stats import EngineStats, MlxMemory, PrefixCacheStats, read_mlx_memory
from mlx_redis_worker.engine.structured import CompiledGrammar
from mlx_redis_worker.engine.vision import VisionPrompt
from mlx_redis_worker.engine.vision_requests import VisionRequests

__all__ = ["AsyncEngineCore", "EngineConfig", "EngineCore"]

log = structlog.get_logger(__name__)


class EngineCore(CacheControl, ReferenceApi, VisionRequests):
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
        draft = self.config.draft
        if draft is not None:
            check_draft_model(model, tokenizer, draft)
        self.scheduler = Scheduler(
            model=model,
            tokenizer=tokenizer,
            config=scheduler_config,
            draft_model=draft.model if draft is not None else None,
        )
        self._engine_thread = EngineThread(self.scheduler, self._on_engine_output, self.config)
        self._max_open = scheduler_config.max_num_seqs + scheduler_config.max_waiting_requests
        self._max_prompt_tokens = scheduler_config.max_prompt_tokens
        self._max_logprobs = scheduler_config.max_logprobs
        self._vocab_size = model_vocab_size(model, tokenizer)
        self._init_vision(model)
        # Where an open request's outputs go: its caller's event loop (add_request), or the
        # blocking batch it is part of (generate_batch_sync, reference_api.py).
        self._request_loops: dict[str, asyncio.AbstractEventLoop] = {}
        self._sync_batches: dict[str, SyncBatch] = {}
        self._output_collectors: dict[str, RequestOutputCollector] = {}
        self._step_listener: Callable[[list[RequestOutput]], None] | None = None
        self._running = False
        self._start_time: float | None = None
        self._fingerprint: str | None = None

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
        ``QueueFullError`` when the engine is full.

        ``prefix_boundary``: the first N prompt tokens are a prefix many requests share (a
        system prompt); the prefix cache keeps their KV state as one entry, stored as soon as
        prefill gets there. ``collect=False`` skips the per-request collector: the outputs then
        reach only the step listener (see ``set_step_listener``), and ``stream_outputs`` has
        nothing to read. ``images`` (each a PIL image, encoded bytes or a file path) and
        ``videos`` (each a list of frames, as images) go with a text prompt to a
        vision-language model (``supports_images``): see ``engine/vision.py`` for where their
        placeholders go; a text-only model refuses them with ``ImagesNotSupportedError``.
        """
        self._check_usable()
        arrival = time.monotonic()
        vision = None
        if images or videos:
            vision = await self._prepare_vision(prompt, images, videos, request_id)
        # Off the loop and off the engine thread: the first constrained request builds the
        # tokenizer's index (about a second), and a new schema compiles (within its limits).
        grammar = None
        if sampling_params is not None and sampling_params.response_format is not None:
            self._check_format_params(sampling_params)
            grammar = await self.scheduler.grammars.compile_async(sampling_params.response_format)
        request = self._make_request(
            prompt,
            sampling_params,
            request_id,
            prefix_boundary,
            stream_interval,
            grammar=grammar,
            vision=vision,
        )
        if vision is not None:
            request.arrival_time = arrival  # its TTFT counts the processing of its images
        if request.request_id in self._request_loops:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        if not self._running:
            await self.start()
        if collect:
            self._output_collectors[request.request_id] = RequestOutputCollector(aggregate=True)
        self._request_loops[request.request_id] = asyncio.get_running_loop()
        self._submit([request])
        if self._aborted_while_prepared(request.request_id):
            # It ends with an abort before the engine admits it (the abort follows the add
            # on the engine thread's queue).
            self._abort_in_background(request.request_id)
        return request.request_id

    def _make_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None,
        request_id: str | None,
        prefix_boundary: int,
        stream_interval: int | None,
        *,
        grammar: CompiledGrammar | None = None,
        vision: VisionPrompt | None = None,
    ) -> Request:
        """A checked request (caller's thread); ``ValueError`` / ``QueueFullError``."""
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError("request_id must be a non-empty string")
        params = sampling_params if sampling_params is not None else SamplingParams()
        speculative = params.speculative
        if (
            speculative is not None
            and speculative.method == "draft_model"
            and not self.config.draft
        ):
            raise ValueError(
                "speculative method draft_model: this engine has no draft model (a worker "
                "names one with --draft-model)"
            )
        if params.logprobs is not None and params.logprobs > self._max_logprobs:
            raise ValueError(
                f"logprobs {params.logprobs} is over this engine's limit of {self._max_logprobs}"
            )
        if vision is not None:
            token_ids = vision.token_ids
        else:
            token_ids = prompt_token_ids(
                self.tokenizer,
                prompt,
                vocab_size=self._vocab_size,
                max_tokens=self._max_prompt_tokens,
            )
        if not 0 <= prefix_boundary <= len(token_ids):
            raise ValueError(
                f"prefix_boundary {prefix_boundary} is not in [0, {len(token_ids)}] "
                "(the prompt's tokens)"
            )
        if grammar is None:
            grammar = self._grammar_for(params)
        interval = self.config.stream_interval if stream_interval is None else stream_interval
        if not isinstance(interval, int) or interval < 1:
            raise ValueError("stream_interval must be an integer >= 1")
        if len(self._request_loops) + len(self._sync_batches) >= self._max_open:
            raise QueueFullError(f"engine is full ({self._max_open} open requests); retry later")
        return Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=token_ids,
            sampling_params=params,
            prefix_boundary=prefix_boundary,
            stream_interval=interval,
            grammar=grammar,
            vision=vision,
        )

    def _grammar_for(self, params: SamplingParams | None) -> CompiledGrammar | None:
        """The compiled response_format of ``params`` (None without one); ``ValueError``
        for a format this engine cannot enforce, or one combined with stop strings."""
        if params is None or params.response_format is None:
            return None
        self._check_format_params(params)
        return self.scheduler.grammars.compile(params.response_format)

    @staticmethod
    def _check_format_params(params: SamplingParams) -> None:
        if params.stop:
            raise ValueError(
                "stop strings cannot be combined with response_format: a cut output would not "
                "match it"
            )

    def _submit(self, requests: list[Request]) -> None:
        """Hand requests to the scheduler on the engine thread; one it refuses (a full queue)
        ends at once with a final ``error`` output."""

        def add_all(scheduler: Scheduler) -> None:
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

    def _forget(self, request_id: str) -> None:
        collector = self._output_collectors.pop(request_id, None)
        if collector is not None:
            collector.clear()
        self._request_loops.pop(request_id, None)

    # -- ending requests, and the engine -----------------------------------------------------

    async def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request; its stream ends with ``finish_reason="abort"``.
        A request whose images are being processed (its ``add_request`` not returned yet) ends
        with an abort as soon as it is added."""
        if self._abort_while_preparing(request_id):
            return True
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
        """Finish open requests, free caches and release the model. Idempotent."""
        if self._closed:
            return
        if self._engine_thread.is_alive():
            with contextlib.suppress(EngineStoppedError):
                self._engine_thread.call_sync(lambda s: s.clear_prefix_cache())
        self._engine_thread.stop()
        self._running = False
        self.scheduler.grammars.close()
        self._close_vision()
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

    def stats(self) -> EngineStats:
        """The engine's counters now (any thread: the scheduler's are read as they stand)."""
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
            requests=self.scheduler.open_requests(),
            health=self._engine_thread.health(),
            scheduler=self.scheduler.stats(),
        )

    def cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's counters; None when it is off."""
        return self.scheduler.cache_stats()

    def memory_stats(self, timeout: float) -> MlxMemory:
        """MLX's allocator figures, read on the engine thread between two steps. Raises
        ``EngineStoppedError`` when that thread is not running and ``TimeoutError`` when a step
        (a long prefill) holds it past ``timeout`` seconds. Blocking: call it off the loop."""
        return self._engine_thread.call_sync(lambda _: read_mlx_memory(), timeout)
