"""An engine stand-in for simulated fleets: the engine's interface, no model and no MLX.

``SimulatedEngine`` steps on the worker's event loop instead of an engine thread: every
``step_seconds`` while it has work, it admits waiting requests into a batch of up to
``max_num_seqs``, gives each running sequence one token and hands the step's outputs to the
step listener, as the real engine does (one call per step, every running request in it).
Its text is made of known words (``fleet_spec.expected_text``), so a subscriber checks a
stream whole; each token's id is the time of the step that made it, in ticks of 100 µs
since ``epoch`` (one clock for the whole machine), so a subscriber measures step-to-subscriber
latency from the events alone. It is an ``EngineCore`` only to the type checker, so the daemon
takes it where it takes an engine; at run time it is a plain class that runs none of the
engine's machinery (no model, no thread) and imports no MLX, mlx-lm or tokenizer stack, so a
simulated fleet runs on a machine that has none of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from mlx_redis_worker.bench.fleet_spec import ticks, word
from mlx_redis_worker.engine.config import EngineConfig, SchedulerConfig
from mlx_redis_worker.engine.errors import QueueFullError
from mlx_redis_worker.engine.request import RequestOutput, SamplingParams, Transcript
from mlx_redis_worker.engine.stats import (
    EngineHealth,
    EngineStats,
    MethodStats,
    MlxMemory,
    RequestProgress,
    SchedulerStats,
    SpeculationStats,
)

if TYPE_CHECKING:
    from mlx_redis_worker.engine.engine_core import EngineCore as EngineInterface
else:
    EngineInterface = object  # the real EngineCore would import MLX


class WordTokenizer:
    """What the daemon asks of a tokenizer for plain text prompts: a token per word."""

    bos_token = None
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(piece) for piece in text.split()]

    def decode(self, token_ids: list[int]) -> str:
        return " ".join("w" for _ in token_ids)


@dataclass(slots=True)
class _Sequence:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    stream_interval: int
    arrived: float
    transcript: Transcript = field(default_factory=Transcript)
    unsent_text: str = ""
    unsent_ids: list[int] = field(default_factory=list)
    aborted: bool = False

    @property
    def generated(self) -> int:
        return len(self.transcript.token_ids)


class SimulatedEngine(EngineInterface):
    """A fixed step time, a batch of up to ``max_num_seqs``, one token per sequence per step."""

    makes_embeddings: ClassVar[bool] = False  # a text model's engine, to the job runner

    def __init__(
        self,
        *,
        step_seconds: float,
        scheduler_config: SchedulerConfig,
        epoch: float,
        model_name: str = "simulated",
    ) -> None:
        # Nothing of EngineCore's: no model to own, no engine thread, no MLX.
        self.tokenizer = WordTokenizer()
        self.config = EngineConfig(model_name=model_name, scheduler_config=scheduler_config)
        self.step_seconds = step_seconds
        self.epoch = epoch
        self.max_num_seqs = scheduler_config.max_num_seqs
        self._max_open = scheduler_config.max_num_seqs + scheduler_config.max_waiting_requests
        self._waiting: list[_Sequence] = []
        self._batch: dict[str, _Sequence] = {}
        self._listener: Callable[[list[RequestOutput]], None] | None = None
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._started = time.time()
        self.steps = 0
        self.step_time = 0.0
        self.processed = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0

    # -- the engine's interface, as the daemon uses it ---------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="simulated engine")

    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def set_step_listener(self, listener: Callable[[list[RequestOutput]], None] | None) -> None:
        self._listener = listener

    async def add_request(  # type: ignore[override]
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        stream_interval: int | None = None,
        **_: Any,
    ) -> str:
        if request_id is None or params is None:
            raise ValueError("a simulated request needs its id and sampling params")
        if len(self._waiting) + len(self._batch) >= self._max_open:
            raise QueueFullError(f"engine is full ({self._max_open} open requests)")
        prompt_tokens = (
            len(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)
        )
        self._waiting.append(
            _Sequence(
                request_id,
                prompt_tokens,
                max(1, params.max_tokens),
                max(1, stream_interval or 1),
                time.time(),
            )
        )
        self._work.set()
        return request_id

    async def abort_request(self, request_id: str) -> bool:
        for sequence in (*self._waiting, *self._batch.values()):
            if sequence.request_id == request_id and not sequence.aborted:
                sequence.aborted = True
                self._work.set()
                return True
        return False

    async def stop(self) -> None:
        """Every open request ends with a final ``abort`` output, as the engine's stop does."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        open_ones = [*self._waiting, *self._batch.values()]
        self._waiting.clear()
        self._batch.clear()
        if open_ones:
            self._emit([self._final(s, "abort") for s in open_ones])

    def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def stats(self) -> EngineStats:
        now = time.time()
        requests = tuple(
            RequestProgress(
                s.request_id,
                "running" if s.request_id in self._batch else "waiting",
                s.prompt_tokens,
                s.generated,
                0,
                now - s.arrived,
            )
            for s in (*self._waiting, *self._batch.values())
        )
        none = MethodStats.of(0, 0, 0, 0)
        return EngineStats(
            engine_id="simulated",
            model_name=self.config.model_name,
            running=self.is_running(),
            uptime_seconds=now - self._started,
            steps_executed=self.steps,
            engine_thread_cpu_seconds=0.0,
            step_seconds=self.step_time,
            active_requests=len(requests),
            stream_interval=self.config.stream_interval,
            requests=requests,
            health=EngineHealth(True, self.is_running(), 0, 0, None, None),
            scheduler=SchedulerStats(
                num_waiting=len(self._waiting),
                num_running=len(self._batch),
                num_requests_processed=self.processed,
                num_requests_failed=0,
                total_prompt_tokens=self.prompt_tokens,
                total_completion_tokens=self.completion_tokens,
                batch_failures=0,
                model_seconds=0.0,
                speculation=SpeculationStats(0, 0, 0, 0, 0, 0, 0.0, 0.0, none, none),
            ),
        )

    def cache_stats(self) -> None:
        return None

    def memory_stats(self, timeout: float) -> MlxMemory:
        return MlxMemory(0, 0, 0)

    async def memory_stats_async(self, timeout: float) -> MlxMemory:
        return MlxMemory(0, 0, 0)

    # -- stepping ----------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if not self._waiting and not self._batch:
                self._work.clear()
                await self._work.wait()
            began = time.perf_counter()
            await asyncio.sleep(self.step_seconds)
            self._step()
            self.step_time += time.perf_counter() - began

    def _step(self) -> None:
        while self._waiting and len(self._batch) < self.max_num_seqs:
            sequence = self._waiting.pop(0)
            self._batch[sequence.request_id] = sequence
            self.prompt_tokens += sequence.prompt_tokens
        for sequence in [s for s in self._waiting if s.aborted]:
            self._waiting.remove(sequence)
            self._batch[sequence.request_id] = sequence
        now_ticks = ticks(self.epoch)
        outputs = []
        for sequence in list(self._batch.values()):
            if sequence.aborted:
                outputs.append(self._final(sequence, "abort"))
                continue
            text = word(sequence.generated)
            sequence.transcript.token_ids.append(now_ticks)
            sequence.transcript.text_parts.append(text)
            sequence.unsent_text += text
            sequence.unsent_ids.append(now_ticks)
            self.completion_tokens += 1
            if sequence.generated >= sequence.max_tokens:
                outputs.append(self._final(sequence, "length"))
            elif sequence.generated % sequence.stream_interval == 0:
                outputs.append(self._output(sequence, finished=False))
        self.steps += 1
        if outputs:
            self._emit(outputs)

    def _final(self, sequence: _Sequence, reason: str) -> RequestOutput:
        self._batch.pop(sequence.request_id, None)
        self.processed += 1
        return self._output(sequence, finished=True, reason=reason)

    def _output(
        self, sequence: _Sequence, *, finished: bool, reason: str | None = None
    ) -> RequestOutput:
        output = RequestOutput(
            request_id=sequence.request_id,
            new_text=sequence.unsent_text,
            new_token_ids=sequence.unsent_ids,
            finished=finished,
            finish_reason=reason,
            prompt_tokens=sequence.prompt_tokens,
            completion_tokens=sequence.generated,
            transcript=sequence.transcript,
            text_parts=sequence.generated,
        )
        sequence.unsent_text, sequence.unsent_ids = "", []
        return output

    def _emit(self, outputs: list[RequestOutput]) -> None:
        if self._listener is not None:
            self._listener(outputs)
