"""Engines that a test builds are closed at its teardown, whatever the test did."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import pytest

from mlx_redis_worker.engine import EngineCore
from tests.support import engines


@pytest.fixture
def closed_at_teardown() -> Iterator[Callable[[EngineCore], EngineCore]]:
    """Hands an engine back and closes it when the test ends (closing twice is harmless)."""
    with contextlib.ExitStack() as stack:

        def track(engine: EngineCore) -> EngineCore:
            return stack.enter_context(contextlib.closing(engine))

        yield track


@pytest.fixture
def make_engine(
    closed_at_teardown: Callable[[EngineCore], EngineCore],
) -> Callable[..., EngineCore]:
    """``make_engine(model_and_tokenizer, **scheduler)``: see ``tests.support.engines``."""

    def build(model_and_tokenizer: tuple[Any, Any], **scheduler: Any) -> EngineCore:
        return closed_at_teardown(engines.make_engine(model_and_tokenizer, **scheduler))

    return build


@pytest.fixture
def engine(tiny_model: Any, make_engine: Callable[..., EngineCore]) -> EngineCore:
    """An engine over the tiny llama with the default scheduler."""
    return make_engine(tiny_model)


@pytest.fixture
def on_a_stream() -> Iterator[Any]:
    """A stream of this thread's own, for tests that step a ``Scheduler`` themselves."""
    stream = mx.new_stream(mx.default_device())
    with mx.stream(stream):
        yield stream
