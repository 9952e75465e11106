"""Loading a model by fixture name, local folder or hub id (always through ``mlx_lm.load``)."""

from __future__ import annotations

from typing import Any

import mlx_lm

from worker.models.paths import resolve_model


def load_model(name_or_path: str) -> tuple[Any, Any]:
    """``mlx_lm.load`` on :func:`resolve_model` of ``name_or_path``: ``(model, tokenizer)``."""
    return mlx_lm.load(resolve_model(name_or_path))  # type: ignore[no-any-return]
