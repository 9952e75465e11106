"""Offline model fixtures (SmolLM2 from a PyPI GGUF, random tiny models) and model loading."""

from mlx_redis_worker.models.loading import ModelUnavailable, load_model
from mlx_redis_worker.models.paths import default_cache_dir, resolve_model
from mlx_redis_worker.models.smollm2 import prepare_smollm2
from mlx_redis_worker.models.tiny import prepare_tiny

__all__ = [
    "ModelUnavailable",
    "default_cache_dir",
    "load_model",
    "prepare_smollm2",
    "prepare_tiny",
    "resolve_model",
]
