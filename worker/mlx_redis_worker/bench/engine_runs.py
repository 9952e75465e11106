"""One way for an in-process bench to run on an engine of its own: built for the bench (no
prefix cache, so runs do not feed each other), started, the scenario awaited, then stopped
and closed whatever happens."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from mlx_redis_worker.engine import EngineConfig, EngineCore, SchedulerConfig
from mlx_redis_worker.engine.config import GrammarLimits

T = TypeVar("T")


def bench_engine(
    model_name: str,
    model: Any,
    tokenizer: Any,
    *,
    max_num_seqs: int,
    grammar_limits: GrammarLimits | None = None,
) -> EngineCore:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        enable_prefix_cache=False,
        grammar_limits=grammar_limits or GrammarLimits(),
    )
    return EngineCore(
        model, tokenizer, EngineConfig(model_name=model_name, scheduler_config=config)
    )


def run_on_engine(engine: EngineCore, scenario: Callable[[], Awaitable[T]]) -> T:
    """``scenario``'s result, run on the started ``engine``; the engine is closed after."""

    async def started() -> T:
        await engine.start()
        try:
            return await scenario()
        finally:
            await engine.stop()

    try:
        return asyncio.run(started())
    finally:
        engine.close()
