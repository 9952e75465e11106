"""Fixtures of the service tests: the tiny model, prepared before a worker needs it (the
redis-server and key prefixes are tests/conftest.py's)."""

from __future__ import annotations

# `mlx_redis_worker` must be imported before anything imports mlx: it loads OpenBLAS first.
import mlx_redis_worker  # noqa: F401  # isort: skip

from pathlib import Path

import pytest


@pytest.fixture
def tiny(tiny_model_path: Path) -> str:
    """``--model tiny``, built into the default cache before a worker needs it (a worker that
    built it itself would spend its start-up time on that)."""
    return "tiny"
