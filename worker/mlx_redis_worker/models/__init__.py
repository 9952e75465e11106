"""Offline model fixtures (SmolLM2 from a PyPI GGUF, random tiny models) and model loading.

Importing this package imports no MLX: the fixture builders load on first use, and
``load_model`` imports mlx-lm when it loads a model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mlx_redis_worker.models.loading import ModelUnavailable, load_model
from mlx_redis_worker.models.paths import default_cache_dir, resolve_model

if TYPE_CHECKING:
    from mlx_redis_worker.models.smollm2 import prepare_smollm2
    from mlx_redis_worker.models.tiny import prepare_tiny

# What loads on first use, and the module it comes from.
_ON_USE = {"prepare_smollm2": "smollm2", "prepare_tiny": "tiny"}


def __getattr__(name: str) -> Any:
    if name not in _ON_USE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_ON_USE[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "ModelUnavailable",
    "default_cache_dir",
    "load_model",
    "prepare_smollm2",
    "prepare_tiny",
    "resolve_model",
]
