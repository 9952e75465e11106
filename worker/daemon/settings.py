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

from protocol.connection import TOPOLOGIES
from protocol.constants import DEFAULT_PREFIX, DEFAULT_REDIS_URL
from protocol.identifiers import ID_RULE, is_valid_id

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
    # redis:// or rediss:// (a single server, or any node of a Cluster), or
    # redis+sentinel://host:port[,host:port…]/service_name[/db].
    redis_url: str = DEFAULT_REDIS_URL
    # What a redis:// URL names: "auto" asks the server (HELLO); "standalone" or "cluster"
    # say it outright.
    redis_topology: str = "auto"
    # Run even when Redis may evict keys under memory pressure (any maxmemory-policy but
    # noeviction), which can drop the job stream, its group and replay logs.
    allow_eviction: bool = False
    # A file holding the Redis URL, so a password stays out of flags, plists and unit files
    # (which other users can read); ``load_settings`` reads it into ``redis_url``.
    redis_url_file: str | None = None
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
        if self.redis_topology not in TOPOLOGIES:
            raise ValueError(f"redis_topology must be one of {', '.join(TOPOLOGIES)}")
        if self.log_format not in ("json", "console"):
            raise ValueError("log_format must be json or console")
        if not is_valid_id(self.worker_id):
            raise ValueError(f"worker_id must be {ID_RULE}, got {self.worker_id!r}")

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
    from_file: dict[str, Any] = {}
    if config_file:
        with open(config_file, "rb") as handle:
            for key, value in tomllib.load(handle).items():
                name = key.replace("-", "_")
                if name not in types:
                    raise ValueError(f"{config_file}: unknown setting {key!r}")
                from_file[name] = value
    from_env: dict[str, Any] = {}
    for name in types:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is not None and raw != "":
            from_env[name] = _parse(name, raw, str(types[name]))
    from_flags = {k: v for k, v in flags.items() if v is not None and k in types}
    merged: dict[str, Any] = {}
    for source in (from_file, from_env, from_flags):
        _merge_redis_url(merged, source)
    if merged.get("redis_url_file"):
        merged["redis_url"] = read_url_file(merged["redis_url_file"])
    return dataclasses.replace(WorkerSettings(), **merged) if merged else WorkerSettings()


def _merge_redis_url(merged: dict[str, Any], source: Mapping[str, Any]) -> None:
    """Merge one source over the lower ones. ``redis_url`` and ``redis_url_file`` are one
    setting: whichever a higher source names replaces both from lower sources (a URL flag
    overrides a file named in the environment), and one source naming both is an error."""
    if "redis_url" in source and "redis_url_file" in source:
        raise ValueError("give redis_url or redis_url_file, not both")
    if "redis_url" in source:
        merged.pop("redis_url_file", None)
    if "redis_url_file" in source:
        merged.pop("redis_url", None)
    merged.update(source)


def read_url_file(path: str) -> str:
    """The one-line URL in ``path`` (surrounding whitespace and the final newline dropped).
    Errors name the file but never echo its contents: they hold a password."""
    try:
        text = Path(path).expanduser().read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"redis_url_file {path}: cannot read it: {exc}") from exc
    if not text or "\n" in text:
        raise ValueError(f"redis_url_file {path}: must hold exactly one line, the Redis URL")
    return text


_TRUE, _FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})


def _parse(name: str, raw: str, annotation: str) -> Any:
    if annotation == "bool":
        if raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a yes/no value")
    try:
        if "int" in annotation and "float" not in annotation:
            return int(raw)
        if "float" in annotation:
            return float(raw)
    except ValueError as exc:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a number") from exc
    return raw
