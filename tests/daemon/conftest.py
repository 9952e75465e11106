"""A private redis-server, worker subprocesses and greedy references for the daemon tests."""

from __future__ import annotations

# `worker` must be imported before anything imports mlx: it loads OpenBLAS first.
import worker  # noqa: F401  # isort: skip

import uuid
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.helpers import WorkerFactory
from worker.engine import EngineCore, SamplingParams
from worker.models import load_model


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Generator[None, Any, None]:
    """Keep each phase's report on the item, so fixtures know whether the test failed."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture
def prefix() -> str:
    """A prefix of this test's own, so tests sharing the server never see each other."""
    return f"d{uuid.uuid4().hex[:12]}"


@pytest.fixture
def workers(
    request: pytest.FixtureRequest, tmp_path: Path, redis_url: str, prefix: str
) -> Iterator[WorkerFactory]:
    """Start worker subprocesses; all are SIGKILLed at the end, logs dumped on failure."""
    factory = WorkerFactory(tmp_path, redis_url, prefix)
    try:
        yield factory
    finally:
        factory.kill_all()
        reports = [getattr(request.node, f"rep_{when}", None) for when in ("setup", "call")]
        if any(report is not None and report.failed for report in reports):
            print(factory.report())


class Reference:
    """Greedy generations of the same tiny model, run directly on an engine in this process."""

    def __init__(self, model_and_tokenizer: tuple[Any, Any]) -> None:
        self.model, self.tokenizer = model_and_tokenizer
        self._known: dict[tuple[str, int], str] = {}

    def texts(self, prompts: Sequence[str], max_tokens: int) -> list[str]:
        missing = [p for p in dict.fromkeys(prompts) if (p, max_tokens) not in self._known]
        if missing:
            engine = EngineCore(self.model, self.tokenizer)
            try:
                outputs = engine.generate_batch_sync(
                    list(missing), SamplingParams(max_tokens=max_tokens, temperature=0.0)
                )
            finally:
                engine.close()
            for prompt, output in zip(missing, outputs, strict=True):
                self._known[(prompt, max_tokens)] = output.output_text
        return [self._known[(p, max_tokens)] for p in prompts]


@pytest.fixture(scope="session")
def reference() -> Reference:
    # A model object of our own: engines take ownership of the model they run.
    return Reference(load_model("tiny"))
