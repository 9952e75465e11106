"""Fixtures of the service tests: a private redis-server and the tiny model, prepared once."""

from __future__ import annotations

# `worker` must be imported before anything imports mlx: it loads OpenBLAS first.
import worker  # noqa: F401  # isort: skip

import uuid
from pathlib import Path

import pytest


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own."""
    return f"ops{uuid.uuid4().hex[:12]}"


@pytest.fixture
def tiny(tiny_model_path: Path) -> str:
    """``--model tiny``, built into the default cache before a worker needs it (a worker that
    built it itself would spend its start-up time on that)."""
    return "tiny"
