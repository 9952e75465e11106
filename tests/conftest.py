"""Shared model fixtures: prepared once into the default cache, loaded once per session."""

from __future__ import annotations

# `worker` must be imported before anything imports mlx: it loads OpenBLAS first.
import worker  # noqa: F401  # isort: skip

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from worker.local_redis import LocalCluster, LocalSentinel, RedisServer
from worker.models import load_model, prepare_smollm2, prepare_tiny


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The random-weight tiny llama (small) folder in the default cache."""
    return prepare_tiny("llama", "small")


@pytest.fixture(scope="session")
def smollm2_model_path() -> Path:
    """SmolLM2-135M-Instruct converted to float32, in the default cache."""
    return prepare_smollm2("float32")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path: Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the tiny llama."""
    return load_model(str(tiny_model_path))


@pytest.fixture(scope="session")
def smollm2_model(smollm2_model_path: Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct (float32)."""
    return load_model(str(smollm2_model_path))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One private redis-server for the session's tests that do not restart it (never the
    Redis on 6379); tests keep apart by key prefix."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """One local 3-master Redis Cluster for the session; tests keep apart by key prefix."""
    with LocalCluster() as cluster:
        yield cluster


@pytest.fixture
def redis_sentinel() -> Iterator[LocalSentinel]:
    """A fresh master + replica + Sentinel per test: a failover leaves the set changed."""
    with LocalSentinel() as sentinel:
        yield sentinel
