"""A blocking wrapper of the async Client, for scripts and code without an event loop.

The async client runs on a private event loop in a daemon thread, so this works the same
whether or not the calling thread has a loop of its own.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from mlx_redis_protocol.client import ChatInput, Client
from mlx_redis_protocol.constants import DEFAULT_CONTROL_TIMEOUT_SECONDS, DEFAULT_REDIS_URL
from mlx_redis_protocol.control import ControlReplies
from mlx_redis_protocol.messages import Event, Job, TerminalEvent

if TYPE_CHECKING:
    from typing import Unpack

    from mlx_redis_protocol.messages import JobOptions

T = TypeVar("T")


class SyncClient:
    """The same methods as `mlx_redis_protocol.client.Client`, blocking. Use ``with
    SyncClient(...)``.

    ``client_options`` are Client's keyword arguments (prefix, log_ttl, limits, ...).
    """

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, **client_options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="mlxw-sync-client", daemon=True
        )
        self._thread.start()
        self._client = self._call(_make_client(redis_url, client_options))

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self._client.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def submit(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        messages: ChatInput | None = None,
        request_id: str | None = None,
        **options: Unpack[JobOptions],
    ) -> str:
        return self._call(
            self._client.submit(
                prompt,
                prompt_token_ids=prompt_token_ids,
                messages=messages,
                request_id=request_id,
                **options,
            )
        )

    def submit_job(self, job: Job) -> str:
        return self._call(self._client.submit_job(job))

    def stream(self, request_id: str, *, timeout: float | None = None) -> Iterator[Event]:
        """The request's events in order; leaving the loop early closes the subscription."""
        events = self._client.stream(request_id, timeout=timeout)
        try:
            while True:
                try:
                    event = self._call(_next(events))
                except StopAsyncIteration:
                    return
                yield event
        finally:
            if not self._loop.is_closed():
                self._call(events.aclose())

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        messages: ChatInput | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        **options: Unpack[JobOptions],
    ) -> TerminalEvent:
        return self._call(
            self._client.generate(
                prompt,
                prompt_token_ids=prompt_token_ids,
                messages=messages,
                request_id=request_id,
                timeout=timeout,
                **options,
            )
        )

    def wait(self, request_id: str, *, timeout: float | None = None) -> TerminalEvent:
        return self._call(self._client.wait(request_id, timeout=timeout))

    def served_models(self) -> frozenset[str]:
        return self._call(self._client.served_models())

    def abort(
        self,
        request_id: str,
        *,
        model: str | None = None,
        timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS,
    ) -> ControlReplies:
        return self._call(self._client.abort(request_id, model=model, timeout=timeout))

    def stats(
        self,
        *,
        worker_id: str | None = None,
        model: str | None = None,
        timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS,
    ) -> ControlReplies:
        return self._call(self._client.stats(worker_id=worker_id, model=model, timeout=timeout))

    def ping(
        self,
        *,
        worker_id: str | None = None,
        model: str | None = None,
        timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS,
    ) -> ControlReplies:
        return self._call(self._client.ping(worker_id=worker_id, model=model, timeout=timeout))

    def cache_save(
        self,
        name: str,
        *,
        worker_id: str | None = None,
        model: str | None = None,
        timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS,
    ) -> ControlReplies:
        return self._call(
            self._client.cache_save(name, worker_id=worker_id, model=model, timeout=timeout)
        )

    def cache_load(
        self,
        name: str,
        *,
        worker_id: str | None = None,
        model: str | None = None,
        timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS,
    ) -> ControlReplies:
        return self._call(
            self._client.cache_load(name, worker_id=worker_id, model=model, timeout=timeout)
        )

    def cache_clear(
        self,
        *,
        worker_id: str | None = None,
        model: str | None = None,
        timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS,
    ) -> ControlReplies:
        return self._call(
            self._client.cache_clear(worker_id=worker_id, model=model, timeout=timeout)
        )

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()


async def _make_client(redis_url: str, options: dict[str, Any]) -> Client:
    # Built on the private loop, so everything the client creates belongs to that loop.
    return Client(redis_url, **options)


async def _next(events: AsyncIterator[Event]) -> Event:
    return await events.__anext__()
