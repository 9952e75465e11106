"""Opening Redis from one URL: a single server, a Redis Cluster, or a master behind Sentinel.

* ``redis://`` and ``rediss://`` name one server. On connect, ``HELLO`` says whether it is a
  Cluster node; if so, redis-py's cluster client takes over (from any node it finds the
  others). ``topology="standalone"`` or ``"cluster"`` skips the question.
* ``redis+sentinel://[user:pass@]host:port[,host:port…]/service_name[/db]`` asks the Sentinels
  for the service's master, and again after every lost connection, so a failover is followed
  without a restart. ``?sentinel_username=…&sentinel_password=…`` authenticate to Sentinels
  that need it.

Callers tell a cluster client apart by its type (``RedisCluster``): on a Cluster, pub/sub is
sharded (``SPUBLISH``/``SSUBSCRIBE``, so a message goes to one shard instead of every node)
and a multi-key script may only carry keys of one hash slot.

No client made here retries a command by itself: redis-py would send a command again after a
timeout, and a timed-out command may have run. Every retry in this project is explicit, in
code that knows the command is safe to repeat (``retry_forever``, ``until_available``).

A Cluster failover (a master dies, its replica takes its slots over) is followed by reading
the slot map again after a failed command (``refresh_slot_map``): redis-py's cluster client
only asks for that itself when one of its commands fails, runs it on a later command, and
never for a pub/sub connection, so a client whose next command is the first after the
promotion, or one that only listens, would go on talking to the dead node.

The cluster client finds the keys of XREAD and XREADGROUP (whose keys follow a STREAMS word,
which redis-py's key-spec reader does not search for) here, not with a ``COMMAND GETKEYS``
round trip to a node before each read (``StreamReadKeys``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from redis._parsers.commands import AsyncCommandsParser
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import AbstractBackoff, EqualJitterBackoff, NoBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    NoPermissionError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from mlx_redis_protocol.errors import ClientError

RedisClient: TypeAlias = Redis | RedisCluster
T = TypeVar("T")
TOPOLOGIES: Final = ("auto", "standalone", "cluster")
SENTINEL_SCHEME: Final = "redis+sentinel"
DEFAULT_SENTINEL_PORT: Final = 26379
# Sharded pub/sub (SPUBLISH, SSUBSCRIBE) arrived in Redis 7.0.
MIN_CLUSTER_VERSION: Final = (7, 0)


class UnsupportedRedis(ValueError):
    """The URL names a server this project cannot use as given (one clear line)."""


# Redis not answering right now: a lost or refused connection, a reply past the socket
# timeout, a Cluster mid-failover or resharding, a replica still loading. Waiting helps.
_UNAVAILABLE: Final = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    ClusterDownError,
    TryAgainError,
    RedisClusterException,
)
# Redis answering "no" to who we are: waiting does not help (the first two are
# ConnectionErrors in redis-py, so they must be told apart from an outage).
REFUSED: Final = (AuthenticationError, AuthorizationError, NoPermissionError)
# Waits between tries while Redis is unreachable: 0.05-0.1 s at first, doubling up to 1-2 s.
# Equal jitter (half fixed, half random): clients that lost Redis together do not all come
# back in the same instant, and no wait is near zero.
RECONNECT_BACKOFF: Final = EqualJitterBackoff(cap=2.0, base=0.05)


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` means Redis cannot be reached now (retry later), as opposed to a
    refusal, a bad command, or one of the client's own errors (some of which are OSErrors)."""
    if isinstance(exc, (ClientError, *REFUSED)):
        return False
    return isinstance(exc, _UNAVAILABLE)


def no_retries() -> Retry:
    """A retry policy that never sends a command twice (see the module docstring)."""
    return Retry(NoBackoff(), 0)


def retry_forever(
    errors: tuple[type[Exception], ...], backoff: AbstractBackoff = RECONNECT_BACKOFF
) -> Retry:
    """redis-py's Retry trying again without end on ``errors``, waiting ``backoff`` between
    tries (``call_with_retry``); only for operations safe to repeat. Cancel the caller to stop."""
    # redis-py annotates the errors as RedisErrors; it catches whatever it is given (OSError,
    # RedisClusterException: a Cluster reshuffling its slots).
    return Retry(backoff, retries=-1, supported_errors=errors)  # type: ignore[arg-type, unused-ignore]


_UNTIL_AVAILABLE: Final = retry_forever(_UNAVAILABLE)


async def refresh_slot_map(redis: RedisClient) -> None:
    """On a Cluster, read the slot map again now (see the module docstring); nothing on a
    single server. Callers that fail at once share one refresh (redis-py's nodes manager
    takes a lock and skips a refresh another caller finished meanwhile); the refresh also
    moves the client's shard subscriptions to their slots' new masters. A refresh that
    reaches no node is not an error here: the caller's next try says whether Redis is back."""
    if not isinstance(redis, RedisCluster):
        return
    try:
        await redis.nodes_manager.initialize()
    except Exception as exc:
        if not is_unavailable(exc):
            raise


async def until_available(
    operation: Callable[[], Awaitable[T]], redis: RedisClient, *, timeout: float
) -> T:
    """Run ``operation`` (Redis commands that are safe to send again) until Redis answers,
    reading the slot map again (``refresh_slot_map``) and backing off (RECONNECT_BACKOFF)
    after each try Redis failed; once Redis has failed it for ``timeout`` seconds, the last
    error is raised. Refusals and other errors are raised at once."""
    give_up_at = time.monotonic() + timeout

    async def failed(exc: Exception) -> None:
        if time.monotonic() >= give_up_at:
            raise exc
        await refresh_slot_map(redis)

    return await _UNTIL_AVAILABLE.call_with_retry(operation, failed, is_retryable=is_unavailable)


async def publish(redis: RedisClient, channel: str, message: bytes) -> int:
    """Publish on a channel (sharded on a Cluster); returns the number of receivers."""
    if isinstance(redis, RedisCluster):
        receivers: int = await redis.spublish(channel, message)
    else:
        receivers = await redis.publish(channel, message)
    return int(receivers)


async def connect(url: str, *, topology: str = "auto", **options: Any) -> RedisClient:
    """A client for ``url`` (see the module docstring), connected and checked.

    ``topology``: "auto" asks the server with HELLO; "cluster" uses the cluster client even
    when HELLO is refused (an ACL without it), and refuses a server that says it is not a
    Cluster node; "standalone" asks nothing.

    ``options`` go to redis-py (socket timeouts, ``max_connections``, TLS settings, ...);
    responses are always bytes. Raises UnsupportedRedis for a URL that names the wrong kind of
    server, redis-py's errors when the server cannot be reached or refuses us.
    """
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {', '.join(TOPOLOGIES)}, got {topology!r}")
    options = {**options, "decode_responses": False, "retry": no_retries()}
    try:
        return await _open(url, topology, options)
    except ResponseError as exc:
        # Not an outage: the server refuses how we connect (SELECT of a database on a
        # Cluster, an ACL without a command the set-up needs). Waiting would not help.
        raise UnsupportedRedis(f"{redact(url)} refused the connection set-up: {exc}") from exc


async def _open(url: str, topology: str, options: dict[str, Any]) -> RedisClient:
    if urlsplit(url).scheme == SENTINEL_SCHEME:
        if topology == "cluster":
            raise UnsupportedRedis("a redis+sentinel:// URL names a master, not a Cluster")
        return await _sentinel_master(parse_sentinel_url(url), options)
    single = Redis.from_url(url, **options)
    try:
        mode, version = (None, None) if topology == "standalone" else await _hello(single)
    except BaseException:
        await single.aclose()
        raise
    if mode == "sentinel" or (topology == "cluster" and mode not in (None, "cluster")):
        await single.aclose()
        if mode == "sentinel":
            raise UnsupportedRedis(
                f"{redact(url)} is a Redis Sentinel: name it as "
                f"{SENTINEL_SCHEME}://HOST:PORT/SERVICE_NAME"
            )
        raise UnsupportedRedis(f"{redact(url)} is not a Redis Cluster node (its mode is {mode})")
    if mode == "cluster" or topology == "cluster":
        await single.aclose()
        _check_cluster_version(version)
        return await _cluster(url, options)
    return single


async def _hello(redis: Redis) -> tuple[str | None, tuple[int, ...] | None]:
    """The server's mode (standalone, cluster, sentinel) and version, from ``HELLO`` with no
    arguments (it changes nothing on the connection). A server that refuses HELLO (too old,
    or an ACL without it) is taken as a single server."""
    try:
        reply = await redis.execute_command("HELLO")  # type: ignore[no-untyped-call]
    except ResponseError as exc:
        if "hello" not in str(exc).lower():  # the connection's own set-up failed
            raise
        return None, None
    finally:
        # A bare HELLO should change nothing, but some servers (fakeredis, the demo's
        # embedded Redis) reset the connection to RESP2 while redis-py still reads RESP3.
        await redis.connection_pool.disconnect()
    if isinstance(reply, list):  # RESP2 servers answer with a flat list of pairs
        reply = dict(zip(reply[0::2], reply[1::2], strict=False))
    fields = {as_text(name): value for name, value in dict(reply).items()}
    mode = as_text(fields.get("mode", b"standalone"))
    version = tuple(
        int(part) for part in as_text(fields.get("version", b"0")).split(".")[:2] if part.isdigit()
    )
    return mode, version


def _check_cluster_version(version: tuple[int, ...] | None) -> None:
    if version is not None and version < MIN_CLUSTER_VERSION:
        found = ".".join(map(str, version))
        raise UnsupportedRedis(
            f"Redis Cluster {found} has no sharded pub/sub (SPUBLISH/SSUBSCRIBE): "
            f"version {'.'.join(map(str, MIN_CLUSTER_VERSION))} or newer is needed"
        )


# Where the server starts searching a stream read's arguments for the STREAMS word (the
# commands' key specs: begin_search keyword STREAMS, startfrom 1 and 4); the first half of
# what follows it are the keys.
_STREAMS_SEARCH_FROM: Final = {"XREAD": 1, "XREADGROUP": 4}


def stream_read_keys(args: Sequence[Any]) -> tuple[Any, ...] | None:
    """The keys of an XREAD or XREADGROUP command (``args`` with the command's name first),
    found as the server finds them; None for any other command, or one the server would
    refuse (no STREAMS, an odd number of streams and ids)."""
    start = _STREAMS_SEARCH_FROM.get(as_text(args[0]).upper()) if args else None
    if start is None:
        return None
    for index in range(start, len(args)):
        if as_text(args[index]).upper() == "STREAMS":
            rest = args[index + 1 :]
            if not rest or len(rest) % 2:
                return None
            return tuple(rest[: len(rest) // 2])
    return None


class StreamReadKeys(AsyncCommandsParser):
    """redis-py's cluster command parser, finding the keys of XREAD and XREADGROUP itself:
    redis-py 8.2 asks a node ``COMMAND GETKEYS`` before each (a round trip as costly as the
    read, as often: one a worker's read loop turn). Every other command as redis-py does."""

    async def get_keys(self, *args: Any) -> tuple[Any, ...] | None:
        keys = stream_read_keys(args)
        if keys is not None:
            return keys
        found: tuple[Any, ...] | None = await super().get_keys(*args)
        return found


async def _cluster(url: str, options: dict[str, Any]) -> RedisCluster:
    parts = urlsplit(url)
    if parts.path.strip("/") not in ("", "0"):
        raise UnsupportedRedis(f"a Redis Cluster has only database 0, the URL names {parts.path}")
    # redis-py's cluster client refuses a database number, even 0.
    cluster = RedisCluster.from_url(urlunsplit(parts._replace(path="")), **options)
    cluster.commands_parser = StreamReadKeys()  # filled in by initialize(), as redis-py's
    try:
        await cluster.initialize()
    except BaseException:
        await cluster.aclose()
        raise
    return cluster


@dataclass(frozen=True, slots=True)
class SentinelAddress:
    """What a ``redis+sentinel://`` URL says."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_options: dict[str, str] = field(default_factory=dict)


def parse_sentinel_url(url: str) -> SentinelAddress:
    """``redis+sentinel://[user:pass@]host:port[,host:port…]/service_name[/db]``; the user and
    password are the master's, ``sentinel_username`` / ``sentinel_password`` query parameters
    the Sentinels'."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        raise ValueError(f"not a {SENTINEL_SCHEME}:// URL")
    credentials, _, hosts = parts.netloc.rpartition("@")
    username, _, password = credentials.partition(":") if credentials else ("", "", "")
    sentinels = tuple(_host_port(host) for host in hosts.split(",") if host)
    path = [unquote(segment) for segment in parts.path.split("/") if segment]
    if not sentinels or not 1 <= len(path) <= 2:
        raise ValueError(
            f"{SENTINEL_SCHEME} URLs look like {SENTINEL_SCHEME}://[user:pass@]host:port"
            "[,host:port…]/service_name[/db]"
        )
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"the database in a {SENTINEL_SCHEME} URL must be a number")
    query = dict(parse_qsl(parts.query))
    unknown = set(query) - {"sentinel_username", "sentinel_password"}
    if unknown:
        raise ValueError(f"unknown {SENTINEL_SCHEME} URL parameters: {', '.join(sorted(unknown))}")
    sentinel_options = {name.removeprefix("sentinel_"): value for name, value in query.items()}
    return SentinelAddress(
        sentinels=sentinels,
        service=path[0],
        db=int(path[1]) if len(path) == 2 else 0,
        username=unquote(username) or None,
        password=unquote(password) or None,
        sentinel_options=sentinel_options,
    )


def _host_port(text: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = text.partition(":")
    if not port:
        return host, DEFAULT_SENTINEL_PORT
    if not port.isdigit():
        raise ValueError(f"bad Sentinel address {text!r}: the port must be a number")
    return host, int(port)


async def _sentinel_master(address: SentinelAddress, options: dict[str, Any]) -> Redis:
    sentinel_options = {
        name: value for name, value in options.items() if name.startswith("socket_")
    }
    sentinel_options.update(address.sentinel_options)
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
        list(address.sentinels), sentinel_kwargs=sentinel_options, **options
    )
    master: Redis = sentinel.master_for(
        address.service,
        db=address.db,
        username=address.username,
        password=address.password,
    )
    try:
        await master.ping()
    except BaseException:
        await master.aclose()
        raise
    return master


def redact(url: str) -> str:
    """The URL without passwords (in the user part or the query), fit for a message."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<the given URL>"
    credentials, at, hosts = parts.netloc.rpartition("@")
    if at and ":" in credentials:
        parts = parts._replace(netloc=f"{credentials.partition(':')[0]}:***@{hosts}")
    if "password" in parts.query:
        query = "&".join(
            f"{name}=***" if "password" in name else f"{name}={value}"
            for name, value in parse_qsl(parts.query, keep_blank_values=True)
        )
        parts = parts._replace(query=query)
    return urlunsplit(parts)


def as_text(value: object) -> str:
    """A reply value as text (clients here never decode responses: events are binary)."""
    return value.decode() if isinstance(value, bytes) else str(value)


async def exists_each(redis: RedisClient, keys: Sequence[str]) -> list[bool]:
    """Whether each key exists, in one round trip (one per node on a Cluster, where keys of
    different slots cannot share an EXISTS)."""
    if not keys:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.exists(key)
        replies = await pipe.execute()
    return [bool(reply) for reply in replies]


async def get_each(redis: RedisClient, keys: Sequence[str]) -> list[bytes | None]:
    """Each key's string value (None where it does not exist), in one round trip (one per
    node on a Cluster)."""
    if not keys:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.get(key)
        replies: list[bytes | None] = await pipe.execute()
    return replies


def raise_if_cancelled() -> None:
    """Raise CancelledError if the current task was asked to cancel and is still running.

    On Python 3.11, ``asyncio.wait_for`` returns normally if its inner future finishes in the
    same loop step as a cancel arrives, dropping the cancellation (fixed in 3.12). redis-py
    sends every command through ``wait_for`` when a socket timeout is set (its default since
    6.x), so a cancelled stream could keep waiting. The task still counts the request
    (``cancelling()``), so long waits call this once per round to honour it.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
