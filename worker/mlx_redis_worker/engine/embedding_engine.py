"""EmbeddingEngineCore: the engine of an embedding model.

The same engine as the text one (``engine_base.EngineBase``: one engine thread, one step loop,
one way out for outputs, abort and stop alike) with a scheduler of the embedding kind
(``embedding_scheduler``), which batches the waiting inputs of many requests into each
forward pass. ``add_embedding_request`` checks and tokenizes a request's inputs off the event
loop (a ``ValueError`` for anything the model cannot take); its outputs carry vectors
(``RequestOutput.embeddings``) and its final one the prompt tokens.

The requests added in one turn of the event loop (a burst: the many small requests of clients
that each wait for their last answer, as a worker's jobs arrive) are made together: their
texts tokenized in one worker-thread call and one tokenizer call, and handed to the engine
thread in one command, so the scheduler's next step sees all of them. One at a time, each
request's own thread hop, tokenizer call and engine-thread wake-up cost more CPU than a
small model's share of the forward pass, and the engine thread, woken by the first, ran
passes of the few that had arrived.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
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


@dataclass(slots=True)
class _Asked:
    """A request as its caller asked for it, waiting in this turn's burst; ``opened``: its
    id once made and handed to the engine thread (or why not)."""

    inputs: list[str | list[int]]
    request_id: str | None
    dimensions: int | None
    collect: bool
    opened: asyncio.Future[str] = field(repr=False)


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
        # The requests asked for in this turn of each event loop, made together (module doc).
        self._asked: dict[asyncio.AbstractEventLoop, list[_Asked]] = {}
        self._bursts: set[asyncio.Task[None]] = set()
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
        if not self._running:
            await self.start()
        loop = asyncio.get_running_loop()
        asked = _Asked(inputs, request_id, dimensions, collect, loop.create_future())
        burst = self._asked.setdefault(loop, [])
        if not burst:
            loop.call_soon(self._make_burst, loop)
        burst.append(asked)
        try:
            return await asked.opened
        except asyncio.CancelledError:
            # Opened for a caller that is gone: end it rather than embed it for nobody.
            opened = asked.opened
            if opened.done() and not opened.cancelled() and opened.exception() is None:
                self._abort_in_background(opened.result())
                self._forget(opened.result())
            raise

    def _make_burst(self, loop: asyncio.AbstractEventLoop) -> None:
        """Event loop: make the requests asked for in the turn that ended (a task, kept)."""
        task = loop.create_task(self._open_burst(self._asked.pop(loop)))
        self._bursts.add(task)
        task.add_done_callback(self._bursts.discard)

    async def _open_burst(self, burst: list[_Asked]) -> None:
        """Check and tokenize a burst off the loop (a megabyte of text takes a while), then
        open its requests and submit them to the engine thread together. Every caller gets
        its request's id or its own error, whatever happens to the others."""
        try:
            made = await asyncio.to_thread(self._make_requests, burst)
            opened: list[tuple[_Asked, EmbeddingRequest]] = []
            for asked, request in zip(burst, made, strict=True):
                if asked.opened.done():  # its caller was cancelled meanwhile
                    continue
                if isinstance(request, Exception):
                    asked.opened.set_exception(request)
                    continue
                try:
                    self._check_usable()
                    self._check_room()
                    self._register(request, collect=asked.collect)
                except Exception as exc:
                    asked.opened.set_exception(exc)
                else:
                    opened.append((asked, request))
            self._submit([request for _, request in opened])  # forgets them if it raises
            for asked, request in opened:
                asked.opened.set_result(request.request_id)
        except asyncio.CancelledError:
            for asked in burst:
                asked.opened.cancel()  # no-op for those already answered
            raise
        except Exception as exc:  # reaches every caller still waiting: none is left hanging
            for asked in burst:
                if not asked.opened.done():
                    asked.opened.set_exception(exc)

    def _make_requests(self, burst: list[_Asked]) -> list[EmbeddingRequest | Exception]:
        """A worker thread: each asked request made (its inputs checked and tokenized), or
        why it cannot be; the texts of all tokenized in one call."""
        model = self.embedding_model
        checked: list[Exception | None] = []
        for asked in burst:
            try:
                self._check_asked(asked)
                checked.append(None)
            except Exception as exc:
                checked.append(exc)
        texts = [
            [item for item in asked.inputs if isinstance(item, str)]
            for asked, error in zip(burst, checked, strict=True)
            if error is None
        ]
        tokenized: list[list[list[int]] | None]
        try:
            tokenized = list(_split(model.tokenize([t for ts in texts for t in ts]), texts))
        except Exception:
            # A text the tokenizer refuses fails its own request only: each on its own.
            tokenized = [None] * len(texts)
        each = iter(tokenized)
        made: list[EmbeddingRequest | Exception] = []
        for asked, error in zip(burst, checked, strict=True):
            if error is not None:
                made.append(error)
                continue
            try:
                made.append(self._make_request(asked, next(each)))
            except Exception as exc:
                made.append(exc)
        return made

    def _check_asked(self, asked: _Asked) -> None:
        """What is checked before tokenizing (``ValueError``)."""
        request_id, inputs, limits = asked.request_id, asked.inputs, self.limits
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError("request_id must be a non-empty string")
        if not isinstance(inputs, list) or not inputs:
            raise ValueError("inputs must be a non-empty list")
        if len(inputs) > limits.max_inputs:
            raise ValueError(f"{len(inputs)} inputs are over the limit of {limits.max_inputs}")
        self.embedding_model.check_dimensions(asked.dimensions)

    def _make_request(self, asked: _Asked, tokenized: list[list[int]] | None) -> EmbeddingRequest:
        """``tokenized``: the request's texts' token ids, None to tokenize them here."""
        model, limits = self.embedding_model, self.limits
        length = model.check_dimensions(asked.dimensions)
        token_ids = model.inputs_ids(asked.inputs, tokenized)
        total = sum(len(ids) for ids in token_ids)
        if total > limits.max_request_tokens:
            raise ValueError(
                f"the inputs are {total} tokens, over the limit of {limits.max_request_tokens} "
                "tokens per request"
            )
        return EmbeddingRequest(asked.request_id or uuid.uuid4().hex, token_ids, length)

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


def _split(flat: list[list[int]], groups: list[list[str]]) -> list[list[list[int]]]:
    """``flat`` (the token ids of every group's texts, in order) cut back into the groups."""
    parts, start = [], 0
    for group in groups:
        parts.append(flat[start : start + len(group)])
        start += len(group)
    return parts
