"""The engine's face: typed stats and the reference API's dicts built from them, MLX memory
read on the engine thread, ``AsyncEngineCore``, and what ``step_interval`` does (nothing)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator
from typing import Any, cast

import pytest

from mlx_redis_worker.engine import (
    AsyncEngineCore,
    EngineConfig,
    EngineCore,
    EngineStoppedError,
    RequestOutput,
    SamplingParams,
)
from mlx_redis_worker.engine.config import SchedulerConfig
from mlx_redis_worker.engine.stats import MlxMemory, plain
from tests.support.engines import PROMPTS, MakeEngine
from tests.support.waiting import run

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)

# get_stats(): the reference API's keys and this engine's additions, in this order.
ENGINE_KEYS = [
    "engine_id",
    "model_name",
    "running",
    "uptime_seconds",
    "steps_executed",
    "engine_thread_cpu_seconds",
    "step_seconds",
    "active_requests",
    "stream_interval",
    "requests",
    "health",
    "num_waiting",
    "num_running",
    "num_requests_processed",
    "num_requests_failed",
    "total_prompt_tokens",
    "total_completion_tokens",
    "batch_failures",
    "model_seconds",
    "speculation",
    "vision",
    "prefill_pace",
]
PREFILL_PACE_KEYS = [
    "budget_tokens",
    "decode_step_seconds",
    "prefill_tokens_per_second",
    "max_prefill_stall",
    "min_prefill_tokens",
    "burst_steps",
]
SPECULATION_KEYS = [
    "steps",
    "rows",
    "draft_tokens",
    "accepted_tokens",
    "backoffs",
    "batch_backoffs",
    "acceptance_rate",
    "tokens_per_step",
    "prompt_lookup",
    "draft_model",
]
# Each method's part of the speculation figures.
SPECULATION_METHOD_KEYS = [
    "steps",
    "rows",
    "draft_tokens",
    "accepted_tokens",
    "acceptance_rate",
    "tokens_per_step",
]
HEALTH_KEYS = [
    "healthy",
    "thread_alive",
    "consecutive_failures",
    "batch_failures",
    "last_error",
    "fatal_error",
]
REQUEST_KEYS = [
    "request_id",
    "status",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "age_seconds",
]
CACHE_KEYS = [
    "enabled",
    "entries",
    "memory_bytes",
    "max_entries",
    "max_bytes",
    "hits",
    "misses",
    "hit_rate",
    "tokens_saved",
    "evictions",
    "stores",
]


def test_the_stats_dicts_are_the_typed_stats(engine: EngineCore) -> None:
    outputs = engine.generate_batch_sync([*PROMPTS[:3]], GREEDY)
    typed, view = engine.stats(), engine.get_stats()
    assert list(view) == ENGINE_KEYS
    assert list(view["health"]) == HEALTH_KEYS and view["requests"] == []
    assert list(view["speculation"]) == SPECULATION_KEYS
    assert view["vision"] is None  # a text model's engine
    assert list(view["prefill_pace"]) == PREFILL_PACE_KEYS
    assert typed.scheduler.prefill_pace is not None
    assert view["prefill_pace"]["max_prefill_stall"] == SchedulerConfig().max_prefill_stall == 0.2
    for method in ("prompt_lookup", "draft_model"):
        assert list(view["speculation"][method]) == SPECULATION_METHOD_KEYS
    assert view["total_completion_tokens"] == typed.scheduler.total_completion_tokens
    assert typed.scheduler.total_completion_tokens == sum(o.completion_tokens for o in outputs)
    assert typed.scheduler.num_requests_processed == view["num_requests_processed"] == 3
    assert view["steps_executed"] == typed.steps_executed > 0
    assert view["model_seconds"] == typed.scheduler.model_seconds > 0
    assert view["health"]["healthy"] is typed.health.healthy is True
    assert view["engine_id"] == typed.engine_id == engine.engine_id

    cache, cache_view = engine.cache_stats(), engine.get_cache_stats()
    assert cache is not None and cache_view is not None
    assert list(cache_view) == CACHE_KEYS
    assert cache_view["entries"] == cache.entries == 3
    assert cache_view["misses"] == cache.misses == 3
    # The views skip asdict's deep copy, and say the same.
    for snapshot in (typed, cache, engine.memory_stats(timeout=5.0)):
        assert plain(snapshot) == dataclasses.asdict(snapshot)


def test_open_requests_are_listed_while_they_run(engine: EngineCore) -> None:
    async def scenario() -> tuple[Any, dict[str, Any]]:
        rid = await engine.add_request(PROMPTS[1], SamplingParams(max_tokens=400))
        stream = cast(AsyncGenerator[RequestOutput, None], engine.stream_outputs(rid))
        await anext(stream)  # it is running
        typed, view = engine.stats(), engine.get_stats()
        await stream.aclose()
        await engine.stop()
        return typed, view

    typed, view = run(scenario())
    (progress,) = typed.requests
    assert progress.status == "running" and progress.completion_tokens >= 1
    assert list(view["requests"][0]) == REQUEST_KEYS
    assert view["requests"][0]["request_id"] == progress.request_id
    assert view["active_requests"] == typed.active_requests == 1


def test_without_a_prefix_cache_there_are_no_cache_stats(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    engine = make_engine(tiny_model, enable_prefix_cache=False)
    assert engine.cache_stats() is None and engine.get_cache_stats() is None


def test_memory_is_read_on_the_engine_thread(engine: EngineCore) -> None:
    with pytest.raises(EngineStoppedError):
        engine.memory_stats(timeout=1.0)  # not started
    engine.generate_batch_sync([*PROMPTS[:1]], GREEDY)
    memory = engine.memory_stats(timeout=5.0)
    assert isinstance(memory, MlxMemory)
    assert memory.active_bytes > 0 and memory.peak_bytes >= memory.active_bytes
    assert memory.cache_bytes >= 0


def test_memory_stats_give_up_while_a_step_holds_the_engine_thread(engine: EngineCore) -> None:
    def slow(_tokens: Any, logits: Any) -> Any:
        time.sleep(1.0)
        return logits

    async def scenario() -> None:
        params = SamplingParams(max_tokens=2, temperature=0.0, logits_processors=[slow])
        rid = await engine.add_request(PROMPTS[0], params)
        await asyncio.sleep(0.3)  # its first step is under way
        with pytest.raises(TimeoutError):
            await asyncio.to_thread(engine.memory_stats, 0.05)
        with pytest.raises(TimeoutError):
            await engine.memory_stats_async(0.05)  # the loop's way: no thread held
        await engine.abort_request(rid)
        assert (await engine.memory_stats_async(5.0)).active_bytes > 0
        await engine.stop()

    run(scenario())
    with pytest.raises(EngineStoppedError):
        engine.memory_stats(timeout=1.0)  # stopped
    with pytest.raises(EngineStoppedError):
        run(engine.memory_stats_async(1.0))


def test_async_engine_core_serves_the_same_greedy_text(tiny_model: Any) -> None:
    model, tokenizer = tiny_model

    wrapper = AsyncEngineCore(model, tokenizer)

    async def scenario() -> tuple[str, str, dict[str, Any]]:
        async with wrapper as engine:
            rid = await engine.add_request(PROMPTS[2], GREEDY)
            streamed = "".join([o.new_text async for o in engine.stream_outputs(rid)])
            whole = await engine.generate(PROMPTS[2], GREEDY)
            return streamed, whole.new_text, engine.get_stats()

    try:
        streamed, whole, stats = run(scenario())
    finally:
        wrapper.engine.close()
    assert streamed == whole and whole
    assert stats["num_requests_processed"] == 2


def test_step_interval_does_not_delay_work(tiny_model: Any) -> None:
    """The idle engine thread blocks until work comes and wakes at once, whatever
    ``step_interval`` says (the reference polls at that interval; this engine does not)."""
    model, tokenizer = tiny_model
    engine = EngineCore(model, tokenizer, EngineConfig(step_interval=30.0))

    async def scenario() -> float:
        await engine.start()
        await engine.generate(PROMPTS[0], GREEDY)  # compiled and idle again
        await asyncio.sleep(0.2)
        started = time.monotonic()
        await engine.generate(PROMPTS[3], GREEDY)
        elapsed = time.monotonic() - started
        await engine.stop()
        return elapsed

    try:
        assert run(scenario()) < 10.0
    finally:
        engine.close()
