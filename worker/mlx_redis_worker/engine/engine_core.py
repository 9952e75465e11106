"""EngineCore: the engine that generates text (API of the reference ``vllm_mlx.engine_core``).

``EngineCore(model, tokenizer, config)`` takes the model (one engine per model) and builds its
scheduler (``scheduler.Scheduler``, a waiting queue in front of mlx-lm's batch generator); the
path every request takes from there (the engine thread, outputs, abort, stop) is
``engine_base.EngineBase``'s, shared with the embedding engine. Here: ``add_request``
tokenizes and checks a generation request in the caller, so bad input is a ``ValueError`` to
whoever sent it and never reaches the batch. The prefix cache's save, load and clear are in
cache_control.py; what only the reference API needs is in reference_api.py; an image
request's way in (its images processed off the loop) is in vision_requests.py.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import structlog

from mlx_redis_worker.engine.cache_control import CacheControl
from mlx_redis_worker.engine.config import EngineConfig, SchedulerConfig
from mlx_redis_worker.engine.engine_base import EngineBase
from mlx_redis_worker.engine.prompt import model_vocab_size, prompt_token_ids
from mlx_redis_worker.engine.reference_api import AsyncEngineCore, ReferenceApi
from mlx_redis_worker.engine.request import Request, RequestOutput, SamplingParams
from mlx_redis_worker.engine.scheduler import Scheduler
from mlx_redis_worker.engine.speculative_batch import check_draft_model
from mlx_redis_worker.engine.stats import PrefixCacheStats, RequestProgress, SchedulerStats
from mlx_redis_worker.engine.structured import CompiledGrammar
from mlx_redis_worker.engine.vision import VisionPrompt
from mlx_redis_worker.engine.vision_requests import VisionRequests

__all__ = ["AsyncEngineCore", "EngineConfig", "EngineCore"]

log = structlog.get_logger(__name__)


class EngineCore(EngineBase[Scheduler], CacheControl, ReferenceApi, VisionRequests):
    """Core engine: continuous batching of many generation requests over one model."""

    def _build_scheduler(self, scheduler_config: SchedulerConfig) -> Scheduler:
        """The scheduler over mlx-lm's batch generator, and the limits a request is checked
        against before it reaches it."""
        self._max_prompt_tokens = scheduler_config.max_prompt_tokens
        self._max_logprobs = scheduler_config.max_logprobs
        self._vocab_size = model_vocab_size(self.model, self.tokenizer)
        self._fingerprint: str | None = None
        self._init_vision(self.model)
        draft = self.config.draft
        if draft is not None:
            check_draft_model(self.model, self.tokenizer, draft)
        return Scheduler(
            model=self.model,
            tokenizer=self.tokenizer,
            config=scheduler_config,
            draft_model=draft.model if draft is not None else None,
        )

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
        request_id = await self._open(request, collect=collect)
        if self._aborted_while_prepared(request_id):
            # It ends with an abort before the engine admits it (the abort follows the add
            # on the engine thread's queue).
            self._abort_in_background(request_id)
        return request_id

    async def add_embedding_request(
        self,
        inputs: list[str | list[int]],
        request_id: str | None = None,
        dimensions: int | None = None,
        *,
        collect: bool = True,
    ) -> str:
        """Refused: this engine generates text (``EmbeddingEngineCore`` embeds)."""
        raise ValueError(
            "this model generates text and makes no embeddings (an embedding job needs a "
            "model served as an embedding model)"
        )

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
        self._check_room()
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

    # -- aborting, closing, and stats --------------------------------------------------------

    async def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request; its stream ends with ``finish_reason="abort"``.
        A request whose images are being processed (its ``add_request`` not returned yet) ends
        with an abort as soon as it is added."""
        if self._abort_while_preparing(request_id):
            return True
        return await super().abort_request(request_id)

    def _free_on_engine_thread(self, scheduler: Scheduler) -> None:
        scheduler.clear_prefix_cache()

    def _free_scheduler(self) -> None:
        self.scheduler.grammars.close()
        self._close_vision()
        self.scheduler.prefix_cache = None

    def _scheduler_stats(self) -> tuple[SchedulerStats, tuple[RequestProgress, ...]]:
        return self.scheduler.stats(), self.scheduler.open_requests()

    def cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's counters; None when it is off."""
        return self.scheduler.cache_stats()
