"""The engine thread: the only thread that touches MLX.

It owns an MLX stream made on itself (MLX streams are per thread), the scheduler and the
BatchGenerator. Other threads talk to it through ``call`` (a command run between steps, with a
``concurrent.futures.Future`` for the result); it hands each step's outputs to ``deliver``.
Idle, it blocks on a condition variable (no polling) and wakes at once on a command or stop. On
stop, or if it dies, every open request is finished (``abort``, or ``error`` with the cause) so
no caller waits forever.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, Protocol, TypeVar

import mlx.core as mx
import structlog

from mlx_redis_worker.engine.config import EngineConfig
from mlx_redis_worker.engine.errors import EngineStoppedError
from mlx_redis_worker.engine.scheduler import SchedulerOutput
from mlx_redis_worker.engine.stats import EngineHealth

log = structlog.get_logger(__name__)

T = TypeVar("T")
MEMORY_CHECK_EVERY = 64  # steps


class StepScheduler(Protocol):
    """What the engine thread (and the path of a request, ``EngineBase``) needs of a
    scheduler: the text scheduler (``scheduler.Scheduler``) and the embedding one
    (``embedding_scheduler.EmbeddingScheduler``) are two kinds of it behind one step loop."""

    batch_failures: int

    def attach_stream(self, stream: Any) -> None: ...

    def add_request(self, request: Any) -> None: ...

    def reject(self, request: Any, message: str) -> None: ...

    def abort_request(
        self, request_id: str, reason: str = "abort", message: str | None = None
    ) -> bool: ...

    def abort_all(self, reason: str = "abort", message: str | None = None) -> SchedulerOutput: ...

    def has_requests(self) -> bool: ...

    def step(self) -> SchedulerOutput: ...

    def close(self) -> None: ...


S = TypeVar("S", bound=StepScheduler)


class EngineThread(Generic[S]):
    def __init__(
        self,
        scheduler: S,
        deliver: Callable[[SchedulerOutput], None],
        config: EngineConfig,
    ) -> None:
        self._scheduler = scheduler
        self._deliver = deliver
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop_reason: tuple[str, str | None] | None = None
        self._memory_threshold = _memory_threshold(config.gpu_memory_utilization)
        self.steps_executed = 0
        self.step_seconds = 0.0
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self.fatal_error: str | None = None
        self._cpu_seconds_of_ended_threads = 0.0
        self._cpu_counted: threading.Thread | None = None

    # -- control (any thread) ----------------------------------------------------------------

    def start(self) -> None:
        if self.is_alive():
            return
        previous = self._thread
        if previous is not None and not self.on_engine_thread():
            previous.join()  # let a stopping thread finish its shutdown first
        with self._wake:
            if self.is_alive():
                return
            self._stop_reason = None
            self.fatal_error = None
            self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
            self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._stop_reason is None

    def on_engine_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def call(self, fn: Callable[[S], T]) -> Future[T]:
        """Run ``fn(scheduler)`` on the engine thread before its next step."""
        future: Future[T] = Future()

        def command() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self._scheduler))
                except BaseException as exc:
                    future.set_exception(exc)

        with self._wake:
            if not self.is_alive():
                future.set_exception(EngineStoppedError(self._why_not_running()))
                return future
            self._commands.append(command)
            self._wake.notify()
        return future

    def call_sync(self, fn: Callable[[S], T], timeout: float | None = None) -> T:
        if self.on_engine_thread():
            return fn(self._scheduler)
        return self.call(fn).result(timeout)

    def stop(self, reason: str = "abort", message: str | None = None, wait: bool = True) -> None:
        """Finish every open request with ``reason`` and end the thread."""
        with self._wake:
            if self._stop_reason is None:
                self._stop_reason = (reason, message)
            self._wake.notify()
        thread = self._thread
        if wait and thread is not None and not self.on_engine_thread():
            thread.join()

    def cpu_seconds(self) -> float:
        """CPU time the engine thread(s) have used: graph building, sampling bookkeeping,
        detokenizing, hand-off (the host work of serving; device time is not in it)."""
        with self._wake:
            total = self._cpu_seconds_of_ended_threads
            thread = self._thread
            running = thread is not None and thread is not self._cpu_counted and thread.is_alive()
        if running and thread is not None and thread.ident is not None:
            with contextlib.suppress(OSError, AttributeError):  # ended meanwhile; not on Unix
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        return total

    def health(self) -> EngineHealth:
        return EngineHealth(
            healthy=self.fatal_error is None and self.consecutive_failures == 0,
            thread_alive=self.is_alive(),
            consecutive_failures=self.consecutive_failures,
            batch_failures=self._scheduler.batch_failures,
            last_error=self.last_error,
            fatal_error=self.fatal_error,
        )

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        stream = mx.new_stream(mx.default_device())
        with mx.stream(stream):
            self._scheduler.attach_stream(stream)
            reason, message = "abort", None
            try:
                self._serve()
                reason, message = self._stop_reason or (reason, message)
            except BaseException as exc:
                self.fatal_error = f"{type(exc).__name__}: {exc}"
                log.exception("engine_thread_died")
                reason, message = "error", f"engine thread died: {self.fatal_error}"
            finally:
                self._shutdown(reason, message)
                with self._wake:
                    self._cpu_seconds_of_ended_threads += time.thread_time()
                    self._cpu_counted = threading.current_thread()

    def _serve(self) -> None:
        idle_cleared = True
        while True:
            for command in self._take_commands():
                command()
            if self._stop_reason is not None:
                return
            if not self._scheduler.has_requests():
                if not idle_cleared:
                    mx.clear_cache()
                    idle_cleared = True
                continue
            idle_cleared = False
            self._step()

    def _take_commands(self) -> list[Callable[[], None]]:
        """The commands sent since the last step; idle, blocks until one arrives or stop. Only
        commands (run on this thread) add work, and ``call``/``stop`` notify under the lock."""
        with self._wake:
            while not self._commands and self._stop_reason is None:
                if self._scheduler.has_requests():
                    break
                self._wake.wait()
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            output = self._scheduler.step()
            self.consecutive_failures = 0
        except Exception as exc:
            # A defect outside one request's processing: fail what is open instead of spinning.
            self.consecutive_failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.exception("engine_step_failed", consecutive_failures=self.consecutive_failures)
            output = self._scheduler.abort_all("error", f"engine step failed: {self.last_error}")
            self._scheduler.close()
        self.steps_executed += 1
        if self.steps_executed % MEMORY_CHECK_EVERY == 0 and (
            mx.get_active_memory() + mx.get_cache_memory() > self._memory_threshold
        ):
            mx.clear_cache()
        # Counted before the hand-off too, so a caller holding a step's outputs sees its time.
        handed_off = time.perf_counter()
        self.step_seconds += handed_off - started
        if output.outputs:
            self._deliver(output)
            self.step_seconds += time.perf_counter() - handed_off

    def _shutdown(self, reason: str, message: str | None) -> None:
        try:
            with self._wake:
                pending = list(self._commands)
                self._commands.clear()
                if self._stop_reason is None:
                    self._stop_reason = (reason, message)
            for command in pending:  # e.g. an add that raced with stop: it is finished below
                command()
            output = self._scheduler.abort_all(reason, message)
            if output.outputs:
                self._deliver(output)
        finally:
            self._scheduler.close()
            mx.clear_cache()
            # MLX frees this thread's streams and compile cache in thread-exit destructors that
            # need the GIL; run late (at interpreter exit) they abort the process (exit 134).
            # Freed here, while Python is whole (mlx's documented duty for worker threads).
            mx.clear_streams()

    def _why_not_running(self) -> str:
        if self.fatal_error is not None:
            return f"engine thread died: {self.fatal_error}"
        return "engine is not running (call start() first, or it was stopped)"


def _memory_threshold(utilization: float) -> int:
    info = mx.device_info()
    total = info.get("memory_size")
    if not isinstance(total, int):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total * min(utilization + 0.05, 0.99))
