"""The continuous-batching inference engine on MLX (no Redis in here).

Public API mirrors the reference ``vllm_mlx.engine_core``.
"""

from mlx_redis_worker.engine.config import EngineConfig, SchedulerConfig
from mlx_redis_worker.engine.embedding_engine import EmbeddingEngineCore
from mlx_redis_worker.engine.engine_core import AsyncEngineCore, EngineCore
from mlx_redis_worker.engine.engine_thread import EngineStoppedError
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
from mlx_redis_worker.engine.scheduler import QueueFullError, Scheduler, SchedulerOutput
from mlx_redis_worker.engine.stats import EngineStats, MlxMemory, PrefixCacheStats, VisionStats
from mlx_redis_worker.engine.vision import ImagesNotSupportedError

# The engine of a served model, of either kind: text (EngineCore) or embeddings.
AnyEngine = EngineCore | EmbeddingEngineCore

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
