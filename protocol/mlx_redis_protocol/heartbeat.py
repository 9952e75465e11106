"""A worker's heartbeat: the JSON value of ``mlxw:worker:{worker_id}`` (see protocol/README.md).

Workers rewrite it every few seconds with a TTL, so the live fleet is the set of these keys. It
advertises what the worker serves: its models, their free slots and caps, the model it runs
jobs that name none with, and its version. Readers are lenient: a heartbeat of an older worker
(no ``models``) still parses, as serving the default stream only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from mlx_redis_protocol.identifiers import is_valid_id

# Numbers a reader takes from a worker's document: exact in a float, so a time or a count
# past it (a hostile or broken writer) cannot overflow the arithmetic that shows it.
MAX_EXACT_INT: Final = 2**53
# The media a model may take besides text, as heartbeats list them.
MEDIA_KINDS: Final = ("image", "video")
# What a reader takes of one worker's heartbeat: a value over this many bytes is no heartbeat
# (a worker of 64 models writes under 16 KiB), and at most this many of its models (those
# past it are left out). So one heartbeat claiming 20,000 models cannot make every reader
# (the catalogue, `mlx-worker models`) do and print 20,000 models' work.
MAX_HEARTBEAT_BYTES: Final = 64 * 1024
MAX_MODELS_PER_WORKER: Final = 64


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model a worker serves, as its heartbeat tells."""

    max_concurrency: int
    free_slots: int
    in_flight: int
    # The media its jobs may carry besides text: "image", "video" (a vision-language model);
    # empty for a text-only model (and from workers that predate media).
    media: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Heartbeat:
    worker_id: str
    pid: int
    started_at: float
    in_flight: int
    # The model this worker forwards jobs naming no model to; for an older worker, whatever
    # it called its model (a path or fixture name).
    default_model: str | None
    models: Mapping[str, ServedModel] = field(default_factory=dict)
    version: str | None = None

    def serves(self, model: str) -> bool:
        return model in self.models

    def encode(self) -> str:
        return json.dumps(
            {
                "worker_id": self.worker_id,
                "pid": self.pid,
                "started_at": self.started_at,
                "in_flight": self.in_flight,
                # Older readers show one model: ``model`` stays, naming the default.
                "model": self.default_model,
                "default_model": self.default_model,
                "models": {
                    name: {
                        "max_concurrency": m.max_concurrency,
                        "free_slots": m.free_slots,
                        "in_flight": m.in_flight,
                        "media": list(m.media),
                    }
                    for name, m in self.models.items()
                },
                "version": self.version,
            }
        )


def decode_heartbeat(raw: bytes | str | None) -> Heartbeat | None:
    """The heartbeat in ``raw``; None for a value that is not one (missing, not JSON, no
    worker id). Fields of the wrong type read as absent rather than fail the whole fleet view."""
    if raw is not None and len(raw) > MAX_HEARTBEAT_BYTES:
        return None
    value = worker_document(raw)
    if value is None:
        return None
    default_model = value.get("default_model", value.get("model"))
    return Heartbeat(
        worker_id=value["worker_id"],
        pid=int_or_zero(value.get("pid")),
        started_at=number_or_zero(value.get("started_at")),
        in_flight=int_or_zero(value.get("in_flight")),
        default_model=default_model if isinstance(default_model, str) else None,
        models=_models(value.get("models")),
        version=value["version"] if isinstance(value.get("version"), str) else None,
    )


def worker_document(raw: bytes | str | None) -> dict[str, Any] | None:
    """A worker's JSON value (heartbeat, activity) as a dict naming its worker; None for a
    missing value, one that is not JSON, or one without a ``worker_id`` that is an id."""
    if raw is None:
        return None
    try:
        value = _clean(json.loads(raw))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    worker_id = value.get("worker_id")
    # Its id names the worker's other keys (activity): one that is no id is no worker's.
    if not isinstance(worker_id, str) or not is_valid_id(worker_id):
        return None
    return value


def _clean(value: Any) -> Any:
    """A decoded JSON value whose every part a reader can show and re-encode: a number that
    is not finite or past 2**53 becomes None (as absent), a string's lone surrogates become
    U+FFFD (they cannot be written as UTF-8)."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8") if _has_surrogate(value) else value
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if abs(value) <= MAX_EXACT_INT else None
    if isinstance(value, float):
        return value if math.isfinite(value) and abs(value) <= MAX_EXACT_INT else None
    if isinstance(value, list):
        return [_clean(item) for item in value]
    if isinstance(value, dict):
        return {_clean(name): _clean(item) for name, item in value.items()}
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _models(value: Any) -> dict[str, ServedModel]:
    if not isinstance(value, dict):
        return {}
    models: dict[str, ServedModel] = {}
    for name, served in value.items():
        if len(models) >= MAX_MODELS_PER_WORKER:
            break
        if isinstance(name, str) and is_valid_id(name) and isinstance(served, dict):
            models[name] = ServedModel(
                max_concurrency=int_or_zero(served.get("max_concurrency")),
                free_slots=int_or_zero(served.get("free_slots")),
                in_flight=int_or_zero(served.get("in_flight")),
                media=_media(served.get("media")),
            )
    return models


def _media(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        return ()
    return tuple(kind for kind in MEDIA_KINDS if kind in value)


def int_or_zero(value: Any) -> int:
    """An integer field (not a bool), or 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def number_or_zero(value: Any) -> float:
    """A number field (not a bool), or 0.0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value)
