"""Events and replies as JSON-ready dicts and as text for people, plus exit codes.

JSON output is strict (no NaN or Infinity tokens): non-finite floats, which only a
log-probability of -inf can produce, become null.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from mlx_redis_protocol.connection import RedisClient, connect, until_available
from mlx_redis_protocol.messages import ControlReply, DoneEvent, ErrorEvent, Event, UnknownEvent

T = TypeVar("T")


class ExitCode(enum.IntEnum):
    """The command line's exit statuses (documented in protocol/README.md)."""

    OK = 0  # done with finish_reason stop or length; a control command answered ok
    ERROR = 1  # an `error` event; a control reply that is not ok
    USAGE = 2  # bad arguments, Redis unreachable or refusing, a protocol violation
    ABORTED = 3  # done with finish_reason abort or expired
    NOT_FOUND = 4  # no such request, or its log expired
    TIMEOUT = 5  # no event / no control reply within --timeout


EXIT_CODES_HELP = """exit status:
  0  done (finish_reason stop or length); control command answered ok
  1  the request ended with an error event; a control reply was not ok
  2  usage error, Redis unreachable or refusing, protocol violation
  3  the request was aborted or expired (finish_reason abort / expired)
  4  unknown request, or its replay log expired
  5  timed out waiting for an event or a control reply"""


# The fleet commands (group, models) make a few calls each; a dead server must not hang them.
ADMIN_SOCKET_TIMEOUT = 10.0
# How long a fleet command waits out Redis being unreachable (a Cluster failover: the slot
# map is read again between tries), as the Client's commands do.
ADMIN_UNAVAILABLE_TIMEOUT = 30.0


async def admin_connection(args: argparse.Namespace) -> RedisClient:
    """The connection of a fleet command (``group``, ``models``), from its common flags."""
    return await connect(
        args.redis_url,
        topology=args.redis_topology,
        socket_timeout=ADMIN_SOCKET_TIMEOUT,
        socket_connect_timeout=ADMIN_SOCKET_TIMEOUT,
    )


async def admin_call(redis: RedisClient, operation: Callable[[], Awaitable[T]]) -> T:
    """A fleet command's work (safe to run again whole), run again while Redis is
    unreachable, for up to ADMIN_UNAVAILABLE_TIMEOUT."""
    return await until_available(operation, redis, timeout=ADMIN_UNAVAILABLE_TIMEOUT)


def exit_code_for(event: DoneEvent | ErrorEvent) -> ExitCode:
    if isinstance(event, ErrorEvent):
        return ExitCode.ERROR
    return ExitCode.OK if event.finish_reason in ("stop", "length") else ExitCode.ABORTED


def event_as_dict(event: Event) -> dict[str, Any]:
    """The event's fields with its ``type`` first, JSON-ready."""
    fields = dataclasses.asdict(event)
    if isinstance(event, UnknownEvent):
        event_type = fields.pop("event_type")
        extra = fields.pop("fields")
        fields = {**extra, **fields}
    else:
        event_type = event.type
    return {"type": event_type, **_json_ready(fields)}


def reply_as_dict(reply: ControlReply) -> dict[str, Any]:
    fields: dict[str, Any] = _json_ready(dataclasses.asdict(reply))
    return fields


def json_line(fields: Mapping[str, Any]) -> str:
    return json.dumps(fields, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def describe_reply(reply: ControlReply, kind: str | None = None) -> str:
    """A reply for people: ``worker: what happened``, from the reply to a command of ``kind``
    (``stats`` or ``cache-load`` alike). A stats reply takes a few aligned lines; a result of a
    shape this reader does not know is shown as JSON."""
    if not reply.ok:
        assert reply.error is not None  # the decoder guarantees an error when not ok
        return f"{reply.worker_id}: error {reply.error.code}: {reply.error.message}"
    result: Mapping[str, Any] = reply.result or {}
    kind = (kind or "").replace("-", "_")
    if kind == "stats":
        return "\n".join(describe_stats(reply.worker_id, result))
    describe = _DESCRIBERS.get(kind)
    described = describe(result) if describe is not None else None
    if described is None:
        shown = json_line(_json_ready(dict(result))) if reply.result is not None else ""
        described = f"ok {shown}".rstrip()
    return f"{reply.worker_id}: {described}"


def describe_stats(worker_id: str, stats: Mapping[str, Any]) -> list[str]:
    """A worker's ``stats`` result as a header and aligned ``label  figures`` lines: what it
    runs, its jobs, throughput, prefix cache, queue group and memory; for a worker of several
    models, those of each model under its name. Sections missing from the map (another worker
    version, a failed probe) are left out, never guessed."""
    models = _section(stats, "models")
    header = []
    uptime = _number(stats.get("uptime_seconds", _section(stats, "engine").get("uptime_seconds")))
    if len(models) > 1:
        header.append(f"models {', '.join(models)}")
        if uptime is not None:
            header.append(f"up {duration(uptime)}")
        lines = [f"{worker_id}: {', '.join(header)}"]
        for name, model in models.items():
            model_header, rows = _model_rows(model if isinstance(model, Mapping) else {})
            lines.append(f"  {name}: {', '.join(model_header)}".rstrip(" :"))
            lines += [f"    {label:<8}{text}" for label, text in rows if text]
        memory = _memory_line(_section(stats, "memory"))
        return lines + ([f"  {'memory':<8}{memory}"] if memory else [])
    model_header, rows = _model_rows(stats)
    header += model_header[:1]
    if uptime is not None:
        header.append(f"up {duration(uptime)}")
    header += model_header[1:]
    rows.insert(4, ("memory", _memory_line(_section(stats, "memory"))))
    shown = [(label, text) for label, text in rows if text]
    if not shown:  # nothing this reader knows: show the map itself
        header.append(json_line(_json_ready(dict(stats))))
    lines = [f"{worker_id}: {', '.join(header)}".rstrip()]
    return lines + [f"  {label:<8}{text}" for label, text in shown]


def _model_rows(stats: Mapping[str, Any]) -> tuple[list[str], list[tuple[str, str]]]:
    """One engine's header words (model, health) and figure lines (empty: it has none)."""
    engine = _section(stats, "engine")
    header = []
    model = engine.get("model_name")
    if model is not None:
        header.append(f"model {model}")
    health = _section(engine, "health")
    if health:
        header.append("healthy" if health.get("healthy") else "UNHEALTHY")
    rows = [
        ("jobs", _jobs_line(engine, _section(stats, "jobs"))),
        ("tokens", _tokens_line(engine)),
        ("cache", _cache_line(stats["prefix_cache"]) if "prefix_cache" in stats else ""),
        ("queue", _queue_line(_section(stats, "group"))),
        ("tenants", _tenants_line(stats.get("tenants"))),
        ("health", _health_problem(health)),
    ]
    return header, rows


# Tenants named on the fair-share line of ``ctl stats`` (its JSON carries them all).
_TENANTS_SHOWN = 5


def _tenants_line(tenants: Any) -> str:
    """Fair share by tenant: waiting (fleet-wide), running on this worker, tokens served in
    the last 10 minutes (fleet-wide). Empty without fair share."""
    if isinstance(tenants, Mapping) and "error" in tenants:
        return f"unreadable: {tenants['error']}"
    if not isinstance(tenants, list):
        return ""
    parts = []
    for share in tenants[:_TENANTS_SHOWN]:
        if isinstance(share, Mapping) and isinstance(share.get("tenant"), str):
            parts.append(
                f"{share['tenant']} {share.get('queued', 0)} queued, "
                f"{share.get('running', 0)} running, {share.get('served_tokens', 0)} tokens"
            )
    if len(tenants) > _TENANTS_SHOWN:
        parts.append(f"{len(tenants) - _TENANTS_SHOWN} more")
    return "; ".join(parts)


def aligned(rows: Sequence[Sequence[str]], align: str) -> list[str]:
    """Rows of cells as lines of aligned columns, two spaces apart; ``align`` has one letter
    per column: ``l`` (left) or ``r`` (right). Trailing spaces are dropped."""
    widths = [max((len(row[i]) for row in rows), default=0) for i in range(len(align))]
    return [
        "  ".join(
            cell.ljust(width) if how == "l" else cell.rjust(width)
            for cell, width, how in zip(row, widths, align, strict=True)
        ).rstrip()
        for row in rows
    ]


def _jobs_line(engine: Mapping[str, Any], jobs: Mapping[str, Any]) -> str:
    parts = []
    for key, name in (("num_running", "running"), ("num_waiting", "waiting")):
        if isinstance(engine.get(key), int):
            parts.append(f"{engine[key]} {name}")
    if isinstance(jobs.get("in_flight"), list):
        parts.append(f"{len(jobs['in_flight'])} in flight")
    outcomes = jobs.get("outcomes")
    if isinstance(outcomes, Mapping):
        counted = ", ".join(f"{name} {count}" for name, count in sorted(outcomes.items()))
        parts.append(f"ended: {counted or 'none yet'}")
    return "; ".join(parts)


def _tokens_line(engine: Mapping[str, Any]) -> str:
    prompt, generated = engine.get("total_prompt_tokens"), engine.get("total_completion_tokens")
    if not isinstance(prompt, int) or not isinstance(generated, int):
        return ""
    line = f"{prompt} prompt, {generated} generated"
    model_seconds = _number(engine.get("model_seconds"))
    if model_seconds:
        # Model time, not wall time: an idle worker's rate stays what it was while it worked.
        line += f"; {generated / model_seconds:.1f} tokens/s of model time"
    if isinstance(engine.get("num_requests_failed"), int) and engine["num_requests_failed"]:
        line += f"; {engine['num_requests_failed']} requests failed in the engine"
    return line


def _cache_line(cache: Any) -> str:
    if cache is None:
        return "prefix cache off"
    if not isinstance(cache, Mapping) or not isinstance(cache.get("entries"), int):
        return ""
    line = _count(cache["entries"], "entry")
    size, bound = _number(cache.get("memory_bytes")), _number(cache.get("max_bytes"))
    if size is not None:
        line += f", {_bytes(size)}" + (f" of {_bytes(bound)}" if bound else "")
    hits, misses = cache.get("hits"), cache.get("misses")
    if isinstance(hits, int) and isinstance(misses, int):
        lookups = hits + misses
        rate = f"{100 * hits / lookups:.0f}%" if lookups else "-"
        line += f"; hit rate {rate} ({hits} of {lookups} lookups)"
    if isinstance(cache.get("tokens_saved"), int):
        line += f"; {cache['tokens_saved']} prompt tokens reused"
    if isinstance(cache.get("evictions"), int) and cache["evictions"]:
        line += f"; {cache['evictions']} evicted"
    return line


def _queue_line(group: Mapping[str, Any]) -> str:
    if "error" in group:
        return f"group unreadable: {group['error']}"
    if "name" not in group:
        return ""
    parts = [f"group {group['name']}"]
    for key, name in (("lag", "lag"), ("pending", "pending"), ("consumers", "consumers")):
        if group.get(key) is not None:
            parts.append(f"{name} {group[key]}")
    return ", ".join(parts)


def _memory_line(memory: Mapping[str, Any]) -> str:
    parts = []
    for key, name in (
        ("rss_bytes", "rss"),
        ("mlx_active_memory_bytes", "MLX active"),
        ("mlx_cache_memory_bytes", "MLX cache"),
        ("mlx_peak_memory_bytes", "MLX peak"),
    ):
        value = _number(memory.get(key))
        if value is not None:
            parts.append(f"{name} {_bytes(value)}")
    if "mlx_error" in memory:
        parts.append(f"MLX figures unavailable ({memory['mlx_error']})")
    return ", ".join(parts)


def _health_problem(health: Mapping[str, Any]) -> str:
    if not health or health.get("healthy"):
        return ""
    problem = health.get("fatal_error") or health.get("last_error") or "see the worker's log"
    failures = health.get("consecutive_failures")
    return f"{failures} failed steps in a row: {problem}" if failures else str(problem)


def _abort(result: Mapping[str, Any]) -> str | None:
    aborted, state = result.get("aborted"), result.get("state")
    if not isinstance(aborted, bool):
        return None
    why = _ABORT_STATES.get(state) if isinstance(state, str) else None
    verdict = "aborted" if aborted else "not aborted"
    return f"{verdict} ({why})" if why else verdict


_ABORT_STATES = {
    "running": "it was running here",
    "queued": "it had not started",
    "finished": "it had already ended",
    "elsewhere": "another worker runs it",
}


def _cache_save(result: Mapping[str, Any]) -> str | None:
    if not isinstance(result.get("entries"), int):
        return None
    return f"saved cache {result.get('name')!r} ({_count(result['entries'], 'entry')})"


def _cache_load(result: Mapping[str, Any]) -> str | None:
    if not isinstance(result.get("loaded"), int):
        return None
    return f"loaded {_count(result['loaded'], 'entry')} from cache {result.get('name')!r}"


def _cache_clear(result: Mapping[str, Any]) -> str | None:
    cleared = result.get("cleared")
    if not isinstance(cleared, Mapping):
        return None
    if cleared and all(isinstance(v, Mapping) for v in cleared.values()):
        # A worker of several models: what each model's caches dropped.
        parts = [f"{model}: {_cleared(v)}" for model, v in cleared.items()]
        return None if any(p.endswith("None") for p in parts) else "; ".join(parts)
    return _cleared(cleared)


def _cleared(cleared: Mapping[str, Any]) -> str | None:
    entries = cleared.get("prefix_cache_entries")
    size, buffers = (
        _number(cleared.get("prefix_cache_bytes")),
        _number(cleared.get("mlx_buffer_cache_bytes")),
    )
    if not isinstance(entries, int) or size is None or buffers is None:
        return None
    return (
        f"cleared {_count(entries, 'prefix cache entry')} ({_bytes(size)}) and "
        f"{_bytes(buffers)} of MLX buffers"
    )


def _ping(result: Mapping[str, Any]) -> str | None:
    return "pong" if result.get("pong") is True else None


_DESCRIBERS: dict[str, Callable[[Mapping[str, Any]], str | None]] = {
    "ping": _ping,
    "abort": _abort,
    "cache_save": _cache_save,
    "cache_load": _cache_load,
    "cache_clear": _cache_clear,
}


def _section(stats: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = stats.get(name)
    return value if isinstance(value, Mapping) else {}


def _number(value: Any) -> float | None:
    """A finite int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _count(count: int, noun: str) -> str:
    if count == 1:
        return f"1 {noun}"
    plural = noun[:-1] + "ies" if noun.endswith("y") else noun + "s"
    return f"{count} {plural}"


def _bytes(size: float) -> str:
    if size < 1024:
        return f"{size:.0f} B"
    exponent = min(int(math.log(size, 1024)), 3)
    return f"{size / 1024**exponent:.1f} {('KiB', 'MiB', 'GiB')[exponent - 1]}"


def duration(seconds: float) -> str:
    """Seconds for people, to the second: ``42s``, ``3m 5s``, ``2h 10m``, ``1d 4h``."""
    total = int(seconds)
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {secs}s" if minutes else f"{secs}s"


def _json_ready(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(key): _json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(item) for item in value]
    return value
