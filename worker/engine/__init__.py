"""The continuous-batching inference engine on MLX (no Redis in here).

Public API mirrors the reference ``vllm_mlx.engine_core``.
"""

from worker.engine.config import EngineConfig, SchedulerConfig
from worker.engine.engine_core import AsyncEngineCore, EngineCore
from worker.engine.engine_thread import EngineStoppedError
from worker.engine.output_collector import RequestOutputCollector, RequestStreamState
from worker.engine.registry import ModelOwnershipError, ModelRegistry, get_registry
from worker.engine.request import (
    Request,
    RequestOutput,
    RequestStatus,
    ResponseFormat,
    SamplingParams,
    TokenLogprob,
)
from worker.engine.scheduler import QueueFullError, Scheduler, SchedulerOutput
from worker.engine.stats import EngineStats, MlxMemory, PrefixCacheStats

__all__ = [
    "AsyncEngineCore",
    "EngineConfig",
    "EngineCore",
    "EngineStats",
    "EngineStoppedError",
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
    "TokenLogprob",
    "get_registry",
]
