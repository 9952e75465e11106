"""EmbeddingEngineCore: the engine of an embedding model.

The same engine as the text one (``engine_base.EngineBase``: one engine thread, one step loop,
one way out for outputs, abort and stop alike) with a scheduler of the embedding kind
(``embedding_scheduler``), which batches the waiting inputs of many requests into each
forward pass. ``add_embedding_request`` checks and tokenizes a request's inputs in the caller
(a ``ValueError`` for anything the model cannot take); its outputs carry vectors
(``RequestOutput.embeddings``) and its final one the prompt tokens.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_redis_worker.engine.config import EngineConfig, SchedulerConfig
from mlx_redis_worker.engine.embedding_model import EmbeddingModel
from mlx_redis_worker.engine.embedding_scheduler import (
    EmbeddingLimits,
    EmbeddingRequest,
    EmbeddingScheduler,
)
from mlx_redis_worker.engine.engine_base import EngineBase
from mlx_redis_worker.engine.stats import RequestProgress, SchedulerStats


@dataclass(frozen=True, slots=True)
class Embeddings:
    """A finished request's vectors (little-endian float32 bytes each, in input order) and
    the tokens its inputs took."""

    vectors: list[bytes]
    prompt_tokens: int


class EmbeddingEngineCore(EngineBase[EmbeddingScheduler]):
    """Continuous batching of many embedding requests over one embedding model."""

    makes_embeddings = True

    def __init__(
        self,
        model: EmbeddingModel,
        config: EngineConfig | None = None,
        limits: EmbeddingLimits | None = None,
        engine_id: str | None = None,
        force_model_ownership: bool = True,
    ) -> None:
        self.embedding_model = model
        self.limits = limits or EmbeddingLimits()
        super().__init__(model.model, model.tokenizer, config, engine_id, force_model_ownership)

    def _build_scheduler(self, scheduler_config: SchedulerConfig) -> EmbeddingScheduler:
        return EmbeddingScheduler(self.embedding_model, self.limits)

    # -- a request's way in ------------------------------------------------------------------

    async def add_embedding_request(
        self,
        inputs: list[str | list[int]],
        request_id: str | None = None,
        dimensions: int | None = None,
        *,
        collect: bool = True,
    ) -> str:
        """Queue the embedding of ``inputs`` (texts, or lists of the model's token ids) and
        return the request's id. ``dimensions``: shorter vectors, where the model documents
        them (``EmbeddingModel.check_dimensions``). Raises ``ValueError`` for bad input (an
        input over the model's token limit, too many inputs or tokens), ``QueueFullError``
        when the engine is full."""
        self._check_usable()
        # Off the event loop: a job's texts may be a megabyte to tokenize.
        request = await asyncio.to_thread(self._make_request, inputs, request_id, dimensions)
        self._check_room()
        return await self._open(request, collect=collect)

    def _make_request(
        self, inputs: list[str | list[int]], request_id: str | None, dimensions: int | None
    ) -> EmbeddingRequest:
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError("request_id must be a non-empty string")
        limits, model = self.limits, self.embedding_model
        if not isinstance(inputs, list) or not inputs:
            raise ValueError("inputs must be a non-empty list")
        if len(inputs) > limits.max_inputs:
            raise ValueError(f"{len(inputs)} inputs are over the limit of {limits.max_inputs}")
        length = model.check_dimensions(dimensions)
        token_ids = model.inputs_ids(inputs)
        total = sum(len(ids) for ids in token_ids)
        if total > limits.max_request_tokens:
            raise ValueError(
                f"the inputs are {total} tokens, over the limit of {limits.max_request_tokens} "
                "tokens per request"
            )
        return EmbeddingRequest(request_id or uuid.uuid4().hex, token_ids, length)

    async def add_request(self, prompt: str | list[int], *args: Any, **kwargs: Any) -> str:
        """Refused: an embedding model generates no text."""
        raise ValueError(
            f"model {self.embedding_model.name!r} is an embedding model: it makes embeddings "
            "(jobs with input), not text"
        )

    async def embed(
        self, inputs: list[str | list[int]], dimensions: int | None = None
    ) -> Embeddings:
        """Embed ``inputs`` to the end; ``RuntimeError`` when the request fails."""
        request_id = await self.add_embedding_request(inputs, dimensions=dimensions)
        vectors: list[bytes] = []
        prompt_tokens = 0
        async for output in self.stream_outputs(request_id):
            vectors += output.embeddings or []
            prompt_tokens = output.prompt_tokens
            if output.finished and output.finish_reason != "stop":
                raise RuntimeError(
                    f"embedding request {request_id} ended with {output.finish_reason}: "
                    f"{output.error}"
                )
        return Embeddings(vectors, prompt_tokens)

    # -- caches (none to keep), and stats ----------------------------------------------------

    def save_cache_to_disk(self, cache_dir: str) -> bool:
        """An embedding model keeps no prefix cache: nothing is saved."""
        return False

    def load_cache_checked(self, cache_dir: str) -> int:
        return 0

    def clear_runtime_caches(self) -> dict[str, Any] | None:
        """Drop MLX's buffer cache (on the engine thread); returns what was freed."""

        def clear(_: EmbeddingScheduler) -> dict[str, Any]:
            buffers = int(mx.get_cache_memory())
            mx.clear_cache()
            return {
                "prefix_cache_entries": 0,
                "prefix_cache_bytes": 0,
                "mlx_buffer_cache_bytes": buffers,
            }

        self._check_usable()
        self._start_engine_thread()
        return self._engine_thread.call_sync(clear)

    def _scheduler_stats(self) -> tuple[SchedulerStats, tuple[RequestProgress, ...]]:
        return self.scheduler.stats(), self.scheduler.open_requests()
