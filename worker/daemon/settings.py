"""Worker settings: one frozen dataclass; flags > ``MLXW_*`` environment > TOML file > defaults."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from protocol.constants import DEFAULT_PREFIX, DEFAULT_REDIS_URL

ENV_PREFIX = "MLXW_"


def default_worker_id() -> str:
    """Host name plus a suffix that is stable across restarts of the same installation, so a
    restarted worker finds its own pending jobs. Run several workers on one host with
    explicit ``--worker-id`` values."""
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:64] or "worker"
    stable = hashlib.sha1(f"{host}|{Path.cwd()}".encode()).hexdigest()[:6]
    return f"{host}-{stable}"


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    model: str = "smollm2"
    redis_url: str = DEFAULT_REDIS_URL
    prefix: str = DEFAULT_PREFIX
    worker_id: str = field(default_factory=default_worker_id)
    max_concurrency: int = 32
    cache_dir: str = "~/.cache/mlx-redis-worker/prefix-caches"
    # A job idle (not refreshed) this long is presumed orphaned and reclaimed by another worker.
    lease_seconds: float = 60.0
    reclaim_interval: float = 10.0
    max_deliveries: int = 3
    drain_timeout: float = 30.0
    # XREADGROUP BLOCK; must stay well below the socket timeout.
    read_block_ms: int = 1000
    socket_timeout: float = 10.0
    heartbeat_interval: float = 5.0
    heartbeat_ttl: float = 15.0
    log_ttl: int = 600
    reply_ttl: int = 60
    stream_interval: int = 1
    log_format: str = "json"
    log_level: str = "INFO"
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        positive = (
            "max_concurrency",
            "lease_seconds",
            "reclaim_interval",
            "max_deliveries",
            "read_block_ms",
            "socket_timeout",
            "heartbeat_interval",
            "heartbeat_ttl",
            "log_ttl",
            "reply_ttl",
            "stream_interval",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.drain_timeout < 0:
            raise ValueError("drain_timeout must be >= 0")
        if self.read_block_ms / 1000 >= self.socket_timeout:
            raise ValueError("read_block_ms must be shorter than socket_timeout")
        if self.heartbeat_ttl <= self.heartbeat_interval:
            raise ValueError("heartbeat_ttl must exceed heartbeat_interval")
        if self.log_format not in ("json", "console"):
            raise ValueError("log_format must be json or console")

    @property
    def lease_refresh_interval(self) -> float:
        return self.lease_seconds / 3

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser()


def load_settings(
    flags: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> WorkerSettings:
    """Merge the sources; ``flags`` holds only options given on the command line (not None)."""
    environ = os.environ if environ is None else environ
    types = {f.name: f.type for f in fields(WorkerSettings)}
    merged: dict[str, Any] = {}
    if config_file:
        with open(config_file, "rb") as handle:
            for key, value in tomllib.load(handle).items():
                name = key.replace("-", "_")
                if name not in types:
                    raise ValueError(f"{config_file}: unknown setting {key!r}")
                merged[name] = value
    for name in types:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is not None and raw != "":
            merged[name] = _parse(name, raw, str(types[name]))
    merged.update({k: v for k, v in flags.items() if v is not None and k in types})
    return dataclasses.replace(WorkerSettings(), **merged) if merged else WorkerSettings()


def _parse(name: str, raw: str, annotation: str) -> Any:
    try:
        if "int" in annotation and "float" not in annotation:
            return int(raw)
        if "float" in annotation:
            return float(raw)
    except ValueError as exc:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a number") from exc
    return raw
