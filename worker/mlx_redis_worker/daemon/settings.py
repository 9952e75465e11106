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
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from mlx_redis_protocol.codec_job import MAX_DRAFT_TOKENS, SPECULATIVE_METHODS
from mlx_redis_protocol.connection import SENTINEL_SCHEME, TOPOLOGIES, parse_sentinel_url
from mlx_redis_protocol.constants import (
    DEFAULT_IDEMPOTENCY_SECONDS,
    DEFAULT_PREFIX,
    DEFAULT_REDIS_URL,
)
from mlx_redis_protocol.heartbeat import MAX_MODELS_PER_WORKER
from mlx_redis_protocol.identifiers import ID_RULE, is_valid_id
from mlx_redis_protocol.limits import DEFAULT_LIMITS, Limits
from mlx_redis_protocol.media_fetch import FetchPolicy
from mlx_redis_protocol.registry import MAX_AHEAD_MS
from mlx_redis_worker.daemon.job_queue import DEFAULT_DEAD_LETTER_MAXLEN

if TYPE_CHECKING:
    from mlx_redis_worker.engine.config import GrammarLimits

ENV_PREFIX = "MLXW_"
# The settings that make up GrammarLimits (its field names; a test checks they agree).
GRAMMAR_SETTINGS = (
    "max_schema_bytes",
    "max_grammar_symbols",
    "max_grammar_lexer_fuel",
    "max_mask_items",
    "max_mask_lexer_fuel",
    "max_lexer_states",
    "max_grammar_compile_ms",
    "max_mask_us",
)


def default_worker_id() -> str:
    """Host name plus a suffix that is stable across restarts of the same installation, so a
    restarted worker finds its own pending jobs. Run several workers on one host with
    explicit ``--worker-id`` values."""
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:64] or "worker"
    stable = hashlib.sha1(f"{host}|{Path.cwd()}".encode()).hexdigest()[:6]
    return f"{host}-{stable}"


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model a worker serves: its name in the fleet (jobs name it, its stream is tagged
    with it) and where it is loaded from (a fixture name, a folder or a hub id)."""

    name: str
    source: str


def parse_models(value: str) -> tuple[ServedModel, ...]:
    """``[NAME=]SOURCE`` items, comma-separated. Without ``NAME=``, the name is the source's
    last path component (``tiny``, ``~/models/qwen3-8b`` -> ``qwen3-8b``)."""
    served = []
    for item in value.split(","):
        item = item.strip()
        name, equals, source = item.partition("=")
        if not equals:
            name, source = Path(item.rstrip("/")).name, item
        if not source:
            raise ValueError(f"model {item!r}: give [NAME=]SOURCE")
        if not is_valid_id(name):
            raise ValueError(
                f"model name {name!r} (of {item!r}) must be {ID_RULE}; name it: NAME={source}"
            )
        served.append(ServedModel(name, source))
    names = [m.name for m in served]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must differ, got {', '.join(names)}")
    return tuple(served)


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    # The models to serve: [NAME=]SOURCE, comma-separated (--model repeated).
    model: str = "smollm2"
    # The model jobs that name none run with (the default stream is forwarded to its stream):
    # give every worker of a fleet the same. None: this worker's first model.
    default_model: str | None = None
    # What the models' weights may take, in MiB; None: the memory the machine has available.
    memory_limit_mb: int | None = None
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
    # Stall-free scheduling: while sequences decode, prefill earns this many measured decode
    # steps of time a step (inf: a whole prefill chunk beside every decode step, the best
    # burst throughput; larger: long prompts beside streams prefill sooner, the streams slower).
    max_prefill_stall: float = 0.2
    # What one job's format (response_format, or its tools' grammar) may cost (over any:
    # invalid_job naming it), in llguidance's units of work, then two wall-clock safety nets:
    # see GrammarLimits. Its defaults, written here so that reading settings does not import
    # the engine (a test checks that they agree).
    max_schema_bytes: int = 128 * 1024
    max_grammar_symbols: int = 500_000
    max_grammar_lexer_fuel: int = 1_000_000
    max_mask_items: int = 50_000
    max_mask_lexer_fuel: int = 200_000
    max_lexer_states: int = 50_000
    max_grammar_compile_ms: int = 30_000
    max_mask_us: int = 250_000
    cache_dir: str = "~/.cache/mlx-redis-worker/prefix-caches"
    # A job idle (not refreshed) this long is presumed orphaned and reclaimed by another worker.
    lease_seconds: float = 60.0
    reclaim_interval: float = 10.0
    # Start each model's waiting jobs by fair share between tenants (every worker of a model
    # should agree), not in the order they came; see docs/fairness.md.
    fair_share: bool = False
    # With fair share: the age bound of priorities (a job waiting this long goes first among
    # its tenant's jobs, whatever their priority), so a low priority never starves.
    priority_age_seconds: float = 30.0
    max_deliveries: int = 3
    # Dead letters kept (approximately: Redis trims whole stream nodes of ~100 entries), so a
    # flood of bad jobs cannot fill Redis; the oldest go first.
    dead_letter_maxlen: int = DEFAULT_DEAD_LETTER_MAXLEN
    drain_timeout: float = 30.0
    # How long the worker waits at start for Redis to answer (and its checks to pass) before it
    # exits with EXIT_REDIS_NEVER_ANSWERED for its service manager to start it again; 0 waits
    # forever. Outages after the start are ridden through, however long.
    redis_start_timeout: float = 60.0
    # XREADGROUP BLOCK: how often an idle worker re-issues its blocked reads (a new job wakes
    # a read at once, a stop cancels it, and fair share files new jobs every second while
    # busy whatever this is), so it is what idle reads cost Redis: at 1 s, two reads per
    # worker per second, half of an idle fleet's commands. Must stay well below the socket
    # timeout, which a blocked read must never reach.
    read_block_ms: int = 5000
    socket_timeout: float = 10.0
    heartbeat_interval: float = 5.0
    heartbeat_ttl: float = 15.0
    # How fresh the status page's running requests and token counts are.
    activity_interval: float = 1.0
    log_ttl: int = 600
    # How long a finished request id is remembered (mlxw:done:{id}): a job queued again under
    # it within this window is acknowledged without running, even after its log expired.
    idempotency_seconds: int = DEFAULT_IDEMPOTENCY_SECONDS
    reply_ttl: int = 60
    stream_interval: int = 1
    log_format: str = "json"
    log_level: str = "INFO"
    metrics_port: int | None = None
    # Speculative decoding for jobs that do not ask for it or against it: "off", or
    # METHOD[:DRAFT_TOKENS] ("prompt_lookup:4"); see parse_speculative.
    speculative: str = "off"
    # The draft model of speculative draft_model (a fixture name, folder or hub id, loaded like
    # the served models); it must share the tokenizer of every model this worker serves.
    draft_model: str | None = None
    # Images and videos of jobs (docs/vision.md): the threads that decode them (off the event
    # loop and the engine thread), and the limits checked before any decoding (Limits').
    media_threads: int = 2
    max_images: int = DEFAULT_LIMITS.max_images
    max_image_bytes: int = DEFAULT_LIMITS.max_image_bytes
    max_image_pixels: int = DEFAULT_LIMITS.max_image_pixels
    max_media_bytes: int = DEFAULT_LIMITS.max_media_bytes
    max_video_bytes: int = DEFAULT_LIMITS.max_video_bytes
    max_video_frames: int = DEFAULT_LIMITS.max_video_frames
    max_video_seconds: int = DEFAULT_LIMITS.max_video_seconds
    # The hosts whose media URLs a job may name (comma-separated; ``*.example.com`` for its
    # subdomains). Empty: this worker fetches no URL. Only public addresses are fetched,
    # unless a network is listed in media_fetch_networks (CIDRs, comma-separated).
    media_fetch_hosts: str = ""
    media_fetch_networks: str = ""
    media_fetch_timeout: float = 10.0

    def __post_init__(self) -> None:
        positive = (
            "max_concurrency",
            "lease_seconds",
            "reclaim_interval",
            "priority_age_seconds",
            "max_deliveries",
            "dead_letter_maxlen",
            "read_block_ms",
            "socket_timeout",
            "heartbeat_interval",
            "heartbeat_ttl",
            "activity_interval",
            "log_ttl",
            "idempotency_seconds",
            "reply_ttl",
            "stream_interval",
            *GRAMMAR_SETTINGS,
            "media_threads",
            "media_fetch_timeout",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.max_prefill_stall >= 0:  # NaN too; inf allowed
            raise ValueError(f"max_prefill_stall must be >= 0, got {self.max_prefill_stall}")
        if self.drain_timeout < 0:
            raise ValueError("drain_timeout must be >= 0")
        if not self.redis_start_timeout >= 0:  # NaN too
            raise ValueError(f"redis_start_timeout must be >= 0, got {self.redis_start_timeout}")
        if self.read_block_ms / 1000 >= self.socket_timeout:
            raise ValueError("read_block_ms must be shorter than socket_timeout")
        if self.heartbeat_ttl <= self.heartbeat_interval:
            raise ValueError("heartbeat_ttl must exceed heartbeat_interval")
        if len(self.models) > MAX_MODELS_PER_WORKER:
            # Readers take no more of a heartbeat's models (a hostile one may claim 20,000).
            raise ValueError(f"a worker serves at most {MAX_MODELS_PER_WORKER} models")
        if self.heartbeat_ttl * 1000 > MAX_AHEAD_MS:
            # The registry drops members that expire further ahead than this (garbage).
            raise ValueError(f"heartbeat_ttl must be at most {MAX_AHEAD_MS // 1000} s")
        if self.redis_topology not in TOPOLOGIES:
            raise ValueError(f"redis_topology must be one of {', '.join(TOPOLOGIES)}")
        if self.log_format not in ("json", "console"):
            raise ValueError("log_format must be json or console")
        if not is_valid_id(self.worker_id):
            raise ValueError(f"worker_id must be {ID_RULE}, got {self.worker_id!r}")
        check_redis_url(self.redis_url)
        parse_models(self.model)
        if self.default_model is not None and not is_valid_id(self.default_model):
            raise ValueError(f"default_model must be {ID_RULE}, got {self.default_model!r}")
        if self.memory_limit_mb is not None and self.memory_limit_mb <= 0:
            raise ValueError("memory_limit_mb must be > 0")
        self.limits  # noqa: B018  # Limits checks its own fields
        self.fetch_policy  # noqa: B018  # a network that is not one
        speculative = parse_speculative(self.speculative)
        if speculative is not None and speculative[0] == "draft_model" and not self.draft_model:
            raise ValueError("speculative draft_model needs a draft model: set draft_model")

    @property
    def models(self) -> tuple[ServedModel, ...]:
        return parse_models(self.model)

    @property
    def default_model_name(self) -> str:
        return self.default_model or self.models[0].name

    @property
    def lease_refresh_interval(self) -> float:
        return self.lease_seconds / 3

    @property
    def grammar_limits(self) -> GrammarLimits:
        from mlx_redis_worker.engine.config import GrammarLimits

        return GrammarLimits(**{name: getattr(self, name) for name in GRAMMAR_SETTINGS})

    @property
    def limits(self) -> Limits:
        """The protocol's limits with this worker's media limits."""
        return dataclasses.replace(
            DEFAULT_LIMITS,
            max_images=self.max_images,
            max_image_bytes=self.max_image_bytes,
            max_image_pixels=self.max_image_pixels,
            max_media_bytes=self.max_media_bytes,
            max_video_bytes=self.max_video_bytes,
            max_video_frames=self.max_video_frames,
            max_video_seconds=self.max_video_seconds,
        )

    @property
    def fetch_policy(self) -> FetchPolicy:
        """Which media URLs jobs may name (none by default)."""
        return FetchPolicy.of(
            self.media_fetch_hosts.split(","),
            self.media_fetch_timeout,
            self.media_fetch_networks.split(","),
        )

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser()


DEFAULT_DRAFT_TOKENS = 4


def parse_speculative(value: str) -> tuple[str, int] | None:
    """``off`` -> None; ``METHOD[:DRAFT_TOKENS]`` -> (method, draft tokens, 4 by default)."""
    method, colon, count = value.strip().partition(":")
    if method == "off" and not colon:
        return None
    methods = [m for m in SPECULATIVE_METHODS if m != "off"]
    if method not in methods:
        raise ValueError(
            f"speculative must be off or METHOD[:DRAFT_TOKENS] with METHOD one of "
            f"{', '.join(methods)}, got {value!r}"
        )
    if not colon:
        return method, DEFAULT_DRAFT_TOKENS
    if not count.isdigit() or not 1 <= int(count) <= MAX_DRAFT_TOKENS:
        raise ValueError(
            f"speculative draft tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got {count!r}"
        )
    return method, int(count)


def load_settings(
    flags: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> WorkerSettings:
    """Merge the sources; ``flags`` holds only options given on the command line (not None).
    Every error is a ValueError of one line naming the setting and where it came from."""
    environ = os.environ if environ is None else environ
    types = {f.name: str(f.type) for f in fields(WorkerSettings)}
    from_file = _read_config(config_file, types) if config_file else {}
    from_env: dict[str, Any] = {}
    for name in types:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is not None and raw != "":
            from_env[name] = _parse(name, raw, types[name])
    from_flags = {k: v for k, v in flags.items() if v is not None and k in types}
    merged: dict[str, Any] = {}
    for source in (from_file, from_env, from_flags):
        _merge_redis_url(merged, source)
    if merged.get("redis_url_file"):
        merged["redis_url"] = read_url_file(merged["redis_url_file"])
    return dataclasses.replace(WorkerSettings(), **merged) if merged else WorkerSettings()


def _read_config(path: str, types: Mapping[str, str]) -> dict[str, Any]:
    """The settings of a TOML file, each checked against its field's type here: a string where
    a number belongs would otherwise surface later as a TypeError far from the file, and
    ``allow_eviction = "yes"`` would count as true only because the string is not empty."""
    try:
        with open(path, "rb") as handle:
            document = tomllib.load(handle)
    except OSError as exc:
        raise ValueError(f"config file {path}: cannot read it: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path}: not valid TOML: {exc}") from exc
    settings: dict[str, Any] = {}
    for key, value in document.items():
        name = key.replace("-", "_")
        if name not in types:
            raise ValueError(f"config file {path}: unknown setting {key!r}")
        if name == "model" and isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = ",".join(value)  # model = ["chat=…", "small=…"]: several models
        settings[name] = _typed(value, types[name], f"config file {path}: {key}")
    return settings


# The TOML value types each field annotation accepts, and how the type is named in messages.
_TOML_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "bool": ((bool,), "true or false"),
    "int": ((int,), "an integer"),
    "float": ((int, float), "a number"),
    "str": ((str,), "a string"),
}


def _typed(value: Any, annotation: str, where: str) -> Any:
    kind = annotation.replace(" | None", "")
    if kind not in _TOML_TYPES:  # a field of another type: WorkerSettings checks it
        return value
    accepted, expected = _TOML_TYPES[kind]
    # bool is an int in Python, but `max_concurrency = true` is a mistake, not 1.
    if isinstance(value, accepted) and (kind == "bool" or not isinstance(value, bool)):
        return float(value) if kind == "float" else value  # type: ignore[arg-type]
    got = type(value).__name__ if not isinstance(value, str) else f"the string {value!r}"
    raise ValueError(f"{where} must be {expected}, got {got}")


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


# Schemes redis-py opens (``unix://`` only for a single server, not a Cluster).
REDIS_URL_SCHEMES = ("redis", "rediss", SENTINEL_SCHEME, "unix")
REDIS_URL_FORMS = (
    "redis://[user:password@]host[:port][/db], rediss://… (TLS), "
    f"{SENTINEL_SCHEME}://[user:password@]host:port[,host:port…]/service_name[/db] "
    "or unix:///path/to/redis.sock"
)


def check_redis_url(url: str) -> None:
    """Refuse a URL no client could open, at settings time, instead of a connection error (or
    a traceback from deep inside redis-py) later. Messages show the URL without what precedes
    its last ``@`` (user and password: in a malformed URL even ``redact`` cannot tell where
    the password ends), and the problem's own text quotes no part of it."""
    problem = _url_problem(url)
    if problem is not None:
        raise ValueError(f"redis_url {_without_credentials(url)!r} is not a Redis URL: {problem}")


def _url_problem(url: str) -> str | None:
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        return str(exc)
    if parts.scheme == SENTINEL_SCHEME:
        try:
            parse_sentinel_url(url)
        except ValueError as exc:  # its message shows the form
            return str(exc)
        return None
    if parts.scheme not in REDIS_URL_SCHEMES:
        return f"{'unknown' if parts.scheme else 'no'} scheme; use {REDIS_URL_FORMS}"
    if parts.scheme == "unix":
        return None if parts.path else "no socket path (unix:///path/to/redis.sock)"
    if not parts.hostname:
        return f"no host; use {REDIS_URL_FORMS}"
    try:
        parts.port  # noqa: B018  (raises for a port that is not a number in range)
    except ValueError:
        return "the port must be a number from 0 to 65535"
    database = parts.path.strip("/")
    if database and not database.isdigit():
        return "what follows the host must be a database number"
    return None


def _without_credentials(url: str) -> str:
    head, at, tail = url.rpartition("@")
    if not at:
        return url
    scheme, separator, _ = head.partition("://")
    return f"{scheme}{separator}***@{tail}" if separator else f"***@{tail}"


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
