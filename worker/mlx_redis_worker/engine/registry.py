"""Model ownership: one engine at a time drives a given model object.

Two engines stepping one model would interleave their MLX work on shared weights and caches.
``acquire`` with ``force=True`` takes the model over: the previous owner is told, stops, and
refuses further work with ``ModelOwnershipError``. Thread-safe.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Protocol


class ModelOwnershipError(RuntimeError):
    """The model is owned by another engine (or this engine's ownership was taken over)."""


class _Owner(Protocol):
    def _on_ownership_revoked(self, new_engine_id: str) -> None: ...


@dataclass(slots=True)
class _Ownership:
    engine_id: str
    engine: weakref.ReferenceType[Any]


class ModelRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: dict[int, _Ownership] = {}

    def acquire(self, model: Any, engine: _Owner, engine_id: str, force: bool = True) -> None:
        previous: Any = None
        with self._lock:
            current = self._owners.get(id(model))
            if current is not None and current.engine_id != engine_id:
                previous = current.engine()
                if previous is not None and not force:
                    raise ModelOwnershipError(
                        f"model is in use by engine {current.engine_id}; close it first or "
                        "pass force_model_ownership=True"
                    )
            self._owners[id(model)] = _Ownership(engine_id, weakref.ref(engine))
        if previous is not None:
            previous._on_ownership_revoked(engine_id)

    def release(self, model: Any, engine_id: str) -> bool:
        with self._lock:
            current = self._owners.get(id(model))
            if current is None or current.engine_id != engine_id:
                return False
            del self._owners[id(model)]
            return True

    def owner_of(self, model: Any) -> str | None:
        with self._lock:
            current = self._owners.get(id(model))
            if current is None or current.engine() is None:
                return None
            return current.engine_id


_registry = ModelRegistry()


def get_registry() -> ModelRegistry:
    return _registry
