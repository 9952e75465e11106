"""The continuous-batching inference engine on MLX (no Redis in here).

Public API mirrors the reference ``vllm_mlx.engine_core``.

Importing this package imports no MLX: its plain types (configs, requests, outputs, stats,
exceptions) load with it, and the engines and the scheduler, which need MLX, mlx-lm and the
tokenizer stack, load on first use (``from mlx_redis_worker.engine import EngineCore``), so
the daemon around them runs where MLX is absent (``mlx-worker bench fleet``'s engine
stand-in).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, TypeAlias

from mlx_redis_worker.engine.config import EngineConfig, SchedulerConfig
from mlx_redis_worker.engine.errors import (
    EngineStoppedError,
    ImagesNotSupportedError,
    QueueFullError,
)
from mlx_redis_worker.engine.output_collector import RequestOutputCollector, RequestStreamState
from mlx_redis_worker.engine.registry import ModelOwnershipError, ModelRegistry, get_registry
from mlx_redis_worker.engine.request import (
    Request,
    RequestOutput,
    RequestStatus,
    ResponseFormat,
    SamplingParams,
    SpeculativeParams,
    TokenLogprob,
)
from mlx_redis_worker.engine.stats import EngineStats, MlxMemory, PrefixCacheStats, VisionStats

if TYPE_CHECKING:
    from mlx_redis_worker.engine.embedding_engine import EmbeddingEngineCore
    from mlx_redis_worker.engine.engine_core import AsyncEngineCore, EngineCore
    from mlx_redis_worker.engine.scheduler import Scheduler, SchedulerOutput

    # The engine of a served model, of either kind: text (EngineCore) or embeddings.
    AnyEngine: TypeAlias = EngineCore | EmbeddingEngineCore

# What loads on first use, and the module it comes from.
_ON_USE = {
    "AsyncEngineCore": "engine_core",
    "EmbeddingEngineCore": "embedding_engine",
    "EngineCore": "engine_core",
    "Scheduler": "scheduler",
    "SchedulerOutput": "scheduler",
}


def __getattr__(name: str) -> Any:
    if name == "AnyEngine":
        value: Any = __getattr__("EngineCore") | __getattr__("EmbeddingEngineCore")
    elif name in _ON_USE:
        value = getattr(importlib.import_module(f"{__name__}.{_ON_USE[name]}"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = [
    "AnyEngine",
    "AsyncEngineCore",
    "EmbeddingEngineCore",
    "EngineConfig",
    "EngineCore",
    "EngineStats",
    "EngineStoppedError",
    "ImagesNotSupportedError",
    "MlxMemory",
    "ModelOwnershipError",
    "ModelRegistry",
    "PrefixCacheStats",
    "QueueFullError",
    "Request",
    "RequestOutput",
    "RequestOutputCollector",
    "RequestStatus",
    "RequestStreamState",
    "ResponseFormat",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SpeculativeParams",
    "TokenLogprob",
    "VisionStats",
    "get_registry",
]
