"""The embedding scheduler: continuous batching of embedding requests.

Engine thread only, behind the same engine thread and step loop as the text scheduler. A
request holds one or more inputs (token ids, checked in the caller). Each ``step`` fills one
batch from the inputs that wait, across requests, under a budget of padded tokens (inputs
times the longest of them, what the forward pass costs): requests take turns one input at a
time, oldest first, so a request of one input is not held behind a request of thousands. The
batch runs in one forward pass; each request gets one output per step with the vectors of its
inputs that the batch held (a contiguous run: a request's inputs are taken in order), and its
final output once its last vector is out. A failed batch fails the requests it held, not the
others.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from mlx_redis_worker.engine.embedding_model import EmbeddingModel, cut_to
from mlx_redis_worker.engine.errors import QueueFullError
from mlx_redis_worker.engine.request import RequestOutput
from mlx_redis_worker.engine.scheduler import SchedulerOutput
from mlx_redis_worker.engine.speculative_batch import SpeculationCounters
from mlx_redis_worker.engine.stats import RequestProgress, SchedulerStats, SpeculationStats

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class EmbeddingLimits:
    """What one step and one request may cost. ``max_batch_tokens``: padded tokens (inputs x
    the longest) one forward pass embeds (an input longer than it runs alone);
    ``max_batch_inputs``: inputs in one pass; ``max_inputs`` / ``max_request_tokens``: a
    request's inputs, and their tokens together (over either, it is refused in the caller);
    ``max_waiting_requests``: requests the scheduler holds."""

    max_batch_tokens: int = 8192
    max_batch_inputs: int = 256
    max_inputs: int = 2048
    max_request_tokens: int = 131072
    max_waiting_requests: int = 1024

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EmbeddingLimits.{name} must be an integer >= 1, got {value!r}")


@dataclass(eq=False)
class EmbeddingRequest:
    """One request's inputs (the model's token ids each) and its progress; ``dimensions``:
    the length of its vectors (checked against the model). Mutated by the engine thread only
    once submitted."""

    request_id: str
    inputs: list[list[int]]
    dimensions: int
    arrival_time: float = field(default_factory=time.monotonic)
    taken: int = 0  # inputs handed to a batch so far (in order)
    first_batch_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.inputs)


class EmbeddingScheduler:
    """A scheduler of the embedding kind (``engine_thread.StepScheduler``)."""

    def __init__(self, model: EmbeddingModel, limits: EmbeddingLimits | None = None) -> None:
        self.model = model
        self.limits = limits or EmbeddingLimits()
        self._requests: dict[str, EmbeddingRequest] = {}  # in arrival order
        self._finished = SchedulerOutput()
        self.prefix_cache = None  # an encoder keeps no KV state between requests
        self.num_requests_processed = 0
        self.num_requests_failed = 0
        self.total_prompt_tokens = 0
        self.batch_failures = 0
        self.batches = 0
        self.inputs_embedded = 0
        self.model_seconds = 0.0
        self._no_speculation = SpeculationCounters()

    # -- requests ----------------------------------------------------------------------------

    def add_request(self, request: EmbeddingRequest) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        if len(self._requests) >= self.limits.max_waiting_requests:
            raise QueueFullError(
                f"embedding queue full ({self.limits.max_waiting_requests} requests); retry later"
            )
        self._requests[request.request_id] = request

    def reject(self, request: EmbeddingRequest, message: str) -> None:
        self._emit(request, "error", error=message)

    def abort_request(
        self, request_id: str, reason: str = "abort", message: str | None = None
    ) -> bool:
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._finish(request, reason, error=message)
        return True

    def abort_all(self, reason: str = "abort", message: str | None = None) -> SchedulerOutput:
        for request in list(self._requests.values()):
            self._finish(request, reason, error=message)
        return self._take_finished()

    def has_requests(self) -> bool:
        return bool(self._requests) or bool(self._finished.outputs)

    # -- stepping ----------------------------------------------------------------------------

    def attach_stream(self, stream: Any) -> None:
        """Nothing to prepare: the forward pass runs on the engine thread's stream."""

    def step(self) -> SchedulerOutput:
        batch = self._take_batch()
        if batch:
            started = time.perf_counter()
            try:
                vectors = self.model.embed([r.inputs[i] for r, i in batch])
            except Exception as exc:
                self._fail_batch(batch, exc)
            else:
                self._hand_out(batch, vectors)
            finally:
                self.model_seconds += time.perf_counter() - started
        return self._take_finished()

    def _take_batch(self) -> list[tuple[EmbeddingRequest, int]]:
        """The inputs of the next forward pass: requests in turn, one input each per round,
        while the padded batch stays within the token budget (at least one input)."""
        limits = self.limits
        batch: list[tuple[EmbeddingRequest, int]] = []
        longest = 0
        waiting = [r for r in self._requests.values() if r.taken < len(r.inputs)]
        while waiting:
            still_waiting = []
            for request in waiting:
                size = len(request.inputs[request.taken])
                padded = (len(batch) + 1) * max(longest, size)
                full = len(batch) >= limits.max_batch_inputs or padded > limits.max_batch_tokens
                if batch and full:
                    return batch
                batch.append((request, request.taken))
                longest = max(longest, size)
                request.taken += 1
                if request.first_batch_time is None:
                    request.first_batch_time = time.monotonic()
                if request.taken < len(request.inputs):
                    still_waiting.append(request)
            waiting = still_waiting
        return batch

    def _hand_out(self, batch: list[tuple[EmbeddingRequest, int]], vectors: Any) -> None:
        """One output per request of the batch: its vectors, in input order."""
        self.batches += 1
        self.inputs_embedded += len(batch)
        by_request: dict[str, tuple[EmbeddingRequest, int, list[bytes]]] = {}
        for row, (request, index) in enumerate(batch):
            entry = by_request.setdefault(request.request_id, (request, index, []))
            entry[2].append(cut_to(vectors[row], request.dimensions))
        for request, first, data in by_request.values():
            done = request.taken == len(request.inputs)  # its last input was in this batch
            if done:
                self._requests.pop(request.request_id)
                self._count(request, "stop")
            self._emit(request, "stop" if done else None, vectors=data, index=first)

    def _fail_batch(self, batch: list[tuple[EmbeddingRequest, int]], exc: BaseException) -> None:
        self.batch_failures += 1
        message = f"batch step failed: {type(exc).__name__}: {exc}"
        log.error("embedding_batch_failed", error=message, inputs=len(batch))
        for request in {id(r): r for r, _ in batch}.values():
            if request.request_id in self._requests:
                self._finish(request, "error", error=message)

    # -- finishing ---------------------------------------------------------------------------

    def _finish(self, request: EmbeddingRequest, reason: str, error: str | None = None) -> None:
        self._requests.pop(request.request_id, None)
        self._count(request, reason)
        if error is not None:
            log.warning("request_failed", request_id=request.request_id, error=error)
        self._emit(request, reason, error=error)

    def _emit(
        self,
        request: EmbeddingRequest,
        reason: str | None,
        *,
        error: str | None = None,
        vectors: list[bytes] | None = None,
        index: int = 0,
    ) -> None:
        """The request's output of this step: its vectors, and its end when ``reason``."""
        self._finished.outputs.append(
            RequestOutput(
                request_id=request.request_id,
                embeddings=vectors,
                embedding_index=index,
                finished=reason is not None,
                finish_reason=reason,
                error=error,
                prompt_tokens=request.num_prompt_tokens,
            )
        )

    def _count(self, request: EmbeddingRequest, reason: str) -> None:
        self.num_requests_processed += 1
        self.num_requests_failed += reason == "error"
        self.total_prompt_tokens += request.num_prompt_tokens

    def _take_finished(self) -> SchedulerOutput:
        finished, self._finished = self._finished, SchedulerOutput()
        return finished

    # -- caches and stats --------------------------------------------------------------------

    def clear_prefix_cache(self) -> dict[str, int]:
        return {"entries": 0, "bytes": 0}

    def stats(self) -> SchedulerStats:
        running = sum(1 for r in list(self._requests.values()) if r.taken > 0)
        return SchedulerStats(
            num_waiting=len(self._requests) - running,
            num_running=running,
            num_requests_processed=self.num_requests_processed,
            num_requests_failed=self.num_requests_failed,
            total_prompt_tokens=self.total_prompt_tokens,
            total_completion_tokens=0,
            batch_failures=self.batch_failures,
            model_seconds=self.model_seconds,
            speculation=SpeculationStats.of(self._no_speculation),
        )

    def open_requests(self) -> tuple[RequestProgress, ...]:
        """Waiting and running requests (any thread: reads a copy of the table);
        ``completion_tokens`` counts the inputs handed to a batch so far."""
        now = time.monotonic()
        return tuple(
            RequestProgress(
                request_id=r.request_id,
                status="running" if r.taken else "waiting",
                prompt_tokens=r.num_prompt_tokens,
                completion_tokens=r.taken,
                cached_tokens=0,
                age_seconds=now - r.arrival_time,
            )
            for r in list(self._requests.values())
        )

    def close(self) -> None:
        """Nothing is held between steps."""
