"""The engine's exceptions, in a module that imports no MLX: the daemon catches them (and a
simulated fleet's engine stand-in raises them) on machines without MLX."""

from __future__ import annotations

from pathlib import Path


class QueueFullError(RuntimeError):
    """The waiting queue is at ``SchedulerConfig.max_waiting_requests``; retry later."""


class EngineStoppedError(RuntimeError):
    """The engine thread is not running (never started, stopped, or died)."""


class ImagesNotSupportedError(ValueError):
    """Images or videos were sent to an engine whose model takes none (the worker's
    ``invalid_job``)."""


class IncompatibleCacheError(Exception):
    """A saved cache this engine must not load: another model's (its KV state would be
    garbage for these weights), another format's, or one that cannot be read. ``reason`` says
    which for the operator; for another model's cache it names both fingerprints."""

    def __init__(
        self,
        directory: Path,
        reason: str,
        saved_fingerprint: str | None = None,
        model_fingerprint: str | None = None,
    ) -> None:
        super().__init__(reason)
        self.directory = directory
        self.reason = reason
        self.saved_fingerprint = saved_fingerprint
        self.model_fingerprint = model_fingerprint
