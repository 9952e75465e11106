"""The control channel: abort, stats, prefix-cache save/load/clear and ping.

Commands arrive on the broadcast channel and on this worker's own channel; each reply is pushed
to the list the command names in ``reply_to`` (the reply that makes the list gives it a TTL),
which must be one of the prefix's reply lists (``mlxw:reply:{token}``): a command naming any
other key is ignored. Cache names are plain names inside ``--cache-dir``: a name with a slash,
``..`` or an absolute path is refused, so no command reads or writes outside that directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from mlx_redis_protocol.channels import MISSED, ChannelHub
from mlx_redis_protocol.codec_control import (
    MAX_KIND_LEN,
    MAX_REPLY_TO_LEN,
    decode_command,
    encode_reply,
)
from mlx_redis_protocol.connection import RedisClient, until_available
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.identifiers import CACHE_NAME_RULE, is_valid_cache_name, is_valid_id
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.limits import Limits
from mlx_redis_protocol.messages import ControlCommand, ControlReply, ErrorInfo
from mlx_redis_protocol.redis_retry import REDIS_FAILURES, describe, retry_until_done
from mlx_redis_protocol.wire import top_level_strings
from mlx_redis_worker.engine.errors import IncompatibleCacheError

if TYPE_CHECKING:
    from mlx_redis_worker.engine import AnyEngine

log = structlog.get_logger(__name__)

# How long a reply is tried again while Redis is unavailable: past a client's usual wait for
# replies (DEFAULT_CONTROL_TIMEOUT_SECONDS), a failover's few seconds included.
REPLY_RETRY_SECONDS = 10.0


class CommandRefused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def cache_path(cache_dir: Path, name: str | None) -> Path:
    """The directory for a saved cache called ``name``, strictly inside ``cache_dir``."""
    if not name or not is_valid_cache_name(name) or ".." in name:
        raise CommandRefused(
            "invalid_field",
            f"cache name {name!r} must be {CACHE_NAME_RULE}, without '..'",
        )
    root = cache_dir.resolve()
    path = (root / name).resolve()
    if path.parent != root:
        raise CommandRefused("invalid_field", f"cache name {name!r} leaves the cache directory")
    return path


class ControlListener:
    def __init__(
        self,
        *,
        redis: RedisClient,
        hub: ChannelHub,
        keys: Keys,
        worker_id: str,
        engines: Mapping[str, AnyEngine],
        cache_dir: Path,
        reply_ttl: int,
        limits: Limits,
        abort_job: Callable[[str, str | None], Awaitable[dict[str, Any]]],
        stats: Callable[[str | None], Awaitable[dict[str, Any]]],
    ) -> None:
        """``engines``: the worker's, by model name; ``abort_job`` runs the abort command for a
        request id and the command's model (the worker knows where a request is: running, in
        its backlog, or only in the stream);
        ``stats`` gives the stats reply (of one model, or of all for None)."""
        self.redis = redis
        self.hub = hub
        self.keys = keys
        self.worker_id = worker_id
        self.engines = engines
        self.cache_dir = cache_dir
        self.reply_ttl = reply_ttl
        self.limits = limits
        self.abort_job = abort_job
        self.stats = stats
        self.handled = 0
        self._tasks: set[asyncio.Task[None]] = set()
        # Set once both channels are subscribed: a command sent after it reaches this worker.
        self.listening = asyncio.Event()

    async def listen(self) -> None:
        """Serve until cancelled. The hub re-subscribes after Redis comes back; commands sent
        while the connection was down are lost (their senders time out), so MISSED is
        ignored."""
        channels = (self.keys.control, self.keys.control_for(self.worker_id))
        async with contextlib.AsyncExitStack() as subscribed:
            # Only subscribing can fail: once subscribed, the hub waits out lost connections.
            inbox = await retry_until_done(
                lambda: subscribed.enter_async_context(self.hub.listen(*channels)),
                "control channel",
            )
            self.listening.set()
            while True:
                data = await inbox.get()
                if data is not MISSED:
                    task = asyncio.create_task(self.handle(data))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)

    async def handle(self, data: object) -> None:
        try:
            command = decode_command(data, self.limits)
        except ProtocolError as exc:
            rejected = _answerable(data)
            answered = rejected is not None and self._is_reply_list(rejected.reply_to)
            log.warning(
                "control_command_rejected", code=exc.code, error=exc.message, answered=answered
            )
            if rejected is not None and answered:
                # It says where to answer: tell the sender why.
                await self._reply(rejected, self._error(rejected, exc.code, exc.message))
            return
        if command.model is not None and command.model not in self.engines:
            # For the workers of another model: they answer it, this one stays silent (the
            # sender counts only the heartbeats that advertise the model).
            return
        if not self._is_reply_list(command.reply_to):
            # RPUSH + EXPIRE on a key the sender picked would let anyone who may publish here
            # append to, or expire, any key (the job stream included): run nothing, answer
            # nothing.
            log.warning("control_command_refused_reply_to", kind=command.kind, id=command.id)
            return
        try:
            reply = ControlReply(
                id=command.id,
                ok=True,
                worker_id=self.worker_id,
                result=await self.dispatch(command),
            )
        except CommandRefused as exc:
            reply = self._error(command, exc.code, exc.message)
        except Exception as exc:
            log.exception("control_command_failed", kind=command.kind)
            reply = self._error(command, "internal", f"{type(exc).__name__}: {exc}")
        self.handled += 1
        await self._reply(command, reply)

    def _is_reply_list(self, reply_to: str) -> bool:
        """Whether ``reply_to`` is one of this prefix's reply lists, ``{prefix}:reply:{token}``
        (the only keys a control command may make the worker write)."""
        head = f"{self.keys.prefix}:reply:{{"
        if not (reply_to.startswith(head) and reply_to.endswith("}")):
            return False
        return is_valid_id(reply_to[len(head) : -1])

    async def _reply(self, command: ControlCommand, reply: ControlReply) -> None:
        """Push the reply, trying again while Redis is unavailable: a reply lost to a failover
        (a Cluster promotes a replica in a few seconds) would leave its sender waiting for a
        worker that did answer. Pushing twice is harmless: the sender keeps one reply per
        worker. Not past ``REPLY_RETRY_SECONDS`` (nor the reply list's life): a sender waits
        about that long at most."""
        encoded = encode_reply(reply)
        tries = 0

        async def push() -> None:
            # One command: the list's TTL is set by the reply that made it (RPUSH answers 1),
            # not by each of a thousand workers' replies. Tried again, the push sends both
            # (an RPUSH that did make the list may have lost its answer).
            nonlocal tries
            tries += 1
            if tries == 1:
                if await self.redis.rpush(command.reply_to, encoded) == 1:
                    await self.redis.expire(command.reply_to, self.reply_ttl)
                return
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.rpush(command.reply_to, encoded)
                pipe.expire(command.reply_to, self.reply_ttl)
                await pipe.execute()

        try:
            await until_available(
                push, self.redis, timeout=min(REPLY_RETRY_SECONDS, float(self.reply_ttl))
            )
        except REDIS_FAILURES as exc:
            log.warning("control_reply_failed", kind=command.kind, error=describe(exc))

    async def dispatch(self, command: ControlCommand) -> dict[str, Any]:
        kind = command.kind
        if kind == "ping":
            return {"pong": True, "time": time.time()}
        if kind == "abort":
            if not command.request_id:
                raise CommandRefused("missing_field", "abort needs request_id")
            return await self.abort_job(command.request_id, command.model)
        if kind == "stats":
            return await self.stats(command.model)
        if kind == "cache_save":
            model, engine = self._one_engine(command)
            path = cache_path(self.cache_dir, command.name)
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            saved = await asyncio.to_thread(engine.save_cache_to_disk, str(path))
            if not saved:
                raise CommandRefused("internal", "the prefix cache could not be saved (see logs)")
            cache = engine.cache_stats()
            entries = cache.entries if cache is not None else 0
            return {"saved": True, "name": command.name, "entries": entries, "model": model}
        if kind == "cache_load":
            model, engine = self._one_engine(command)
            path = cache_path(self.cache_dir, command.name)
            if not path.is_dir():
                raise CommandRefused("not_found", f"no saved cache named {command.name!r}")
            try:
                loaded = await asyncio.to_thread(engine.load_cache_checked, str(path))
            except IncompatibleCacheError as exc:
                # Not `loaded: 0`: the operator must learn the cache is unusable here, and why.
                raise CommandRefused(
                    "incompatible_cache", f"cache {command.name!r}: {exc.reason}"
                ) from exc
            return {"loaded": loaded, "name": command.name, "model": model}
        if kind == "cache_clear":
            cleared: dict[str, Any] = {
                model: await asyncio.to_thread(engine.clear_runtime_caches) or {}
                for model, engine in self.engines.items()
                if command.model in (None, model)
            }
            # A worker of one model answers as before models: what was dropped, by cache.
            return {"cleared": next(iter(cleared.values())) if len(self.engines) == 1 else cleared}
        raise CommandRefused("unknown_command", f"unknown command {kind!r}")

    def _one_engine(self, command: ControlCommand) -> tuple[str, AnyEngine]:
        """The engine a cache save or load is for: the command's model, or the worker's only
        one. A saved cache holds one model's state, so a worker of several needs the name;
        an embedding model keeps none."""
        if command.model is not None:
            model, engine = command.model, self.engines[command.model]
        elif len(self.engines) == 1:
            model, engine = next(iter(self.engines.items()))
        else:
            raise CommandRefused(
                "invalid_field",
                f"{command.kind} needs model: this worker serves {', '.join(self.engines)}",
            )
        if engine.makes_embeddings:
            raise CommandRefused(
                "invalid_field", f"model {model!r} is an embedding model: it keeps no prefix cache"
            )
        return model, engine

    def _error(self, command: ControlCommand, code: str, message: str) -> ControlReply:
        return ControlReply(
            id=command.id, ok=False, worker_id=self.worker_id, error=ErrorInfo(code, message)
        )


def _answerable(data: object) -> ControlCommand | None:
    """A command that failed validation, reduced to where its refusal can go: its
    ``reply_to``, read even from a partly invalid message (a wrong version, bad fields), so
    the sender gets the refusal instead of waiting for its timeout. Its ``id`` when valid,
    else "" (the reply list alone then tells the sender which command it was)."""
    fields = top_level_strings(data, ("id", "reply_to", "kind"))
    reply_to = fields.get("reply_to")
    if reply_to is None or not 0 < len(reply_to) <= MAX_REPLY_TO_LEN:
        return None
    command_id = fields.get("id", "")
    kind = fields.get("kind", "?")[:MAX_KIND_LEN]
    return ControlCommand(
        kind=kind, id=command_id if is_valid_id(command_id) else "", reply_to=reply_to
    )
