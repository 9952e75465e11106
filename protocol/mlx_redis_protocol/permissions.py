"""Checking Redis permissions before serving: probes, the runner, and the operator's line.

Redis checks an ACL user's rights per command, key and channel when a command runs, also for
each command a Lua script calls. A user without a grant lets a process start and serve; the task
that needs it then fails later, in a log line nobody reads. So the worker and the gateway send
each command they will ever send (directly or from their scripts) once at start, on keys and
channels of their own prefix shaped like the real ones (hash tags included, so a Cluster routes
each to its node), with arguments that change nothing, and stop with one line naming the first
one refused. The worker's probes are in ``mlx_redis_worker.daemon.permissions``, the gateway's
in ``mlx_redis_gateway.permissions``; what they share is here.

Redis checks the ACL before it looks at a command's arguments, so any reply other than
``NOPERM`` means the command is allowed, an error about the arguments included; some probes
rely on that (``XADD … 0-0`` is always refused as an ID, never appended).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoPermissionError, ResponseError

from mlx_redis_protocol.channels import ChannelHub
from mlx_redis_protocol.connection import SENTINEL_SCHEME, RedisClient, parse_sentinel_url
from mlx_redis_protocol.keys import Keys

log = logging.getLogger(__name__)

_COMMAND_REFUSED = re.compile(r"run the '([^']+)' command")
# The Lua probe: it touches nothing. Loading it first makes the EVALSHA probe run it rather
# than answer NOSCRIPT (on a Cluster, SCRIPT LOAD reaches every master).
_PROBE_SCRIPT = "return 1"
_PROBE_SHA = hashlib.sha1(_PROBE_SCRIPT.encode()).hexdigest()


class MissingPermission(Exception):
    """Redis refuses a user a command, key or channel it needs (one line)."""


@dataclass(frozen=True, slots=True)
class Probe:
    command: str  # as a person reads it; ACL rules write "XGROUP DELCONSUMER" +xgroup|delconsumer
    needed_to: str  # what the worker could not do without it
    subject: str  # the key or channel it touches, for a refusal of that
    send: Callable[[], Awaitable[object]]


def redis_user(url: str) -> str:
    """The ACL user a URL logs in as (``default`` when it names none)."""
    try:
        if urlsplit(url).scheme == SENTINEL_SCHEME:
            return parse_sentinel_url(url).username or "default"
        return unquote(urlsplit(url).username or "") or "default"
    except ValueError:
        return "default"


async def check_probes(probes: Iterable[Probe], user: str, keys: Keys) -> None:
    """Send each probe in turn; MissingPermission for the first one Redis refuses."""
    for probe in probes:
        try:
            await probe.send()
        except NoPermissionError as exc:
            raise MissingPermission(refusal(user, keys, probe, exc)) from exc
        except ResponseError:
            pass  # allowed: only the arguments were refused (see the module docstring)
    log.debug("redis_permissions_checked", extra={"user": user})


def refusal(user: str, keys: Keys, probe: Probe, exc: NoPermissionError) -> str:
    """The operator's line for a refused probe: which command, key or channel, and why the
    worker needs it. Redis names the command it refused (a pipeline's or script's may differ
    from the probe's); for a key or a channel it only says which kind."""
    text = str(exc)
    grant = "see docs/redis.md: minimum ACL"
    if (command := _COMMAND_REFUSED.search(text)) is not None:
        name = command.group(1).replace("|", " ").upper()
        return (
            f"Redis user {user!r} may not run {name} (needed to {probe.needed_to}); "
            f"grant it ({grant})"
        )
    kind, rule = ("channel", "&") if "channel" in text else ("key", "~")
    # The key table's row for the subject's kind (``mlxw:forwarded:{MODEL}:ID``), when it is
    # not the subject itself: the line of an ACL that is missing.
    pattern = keys.pattern_of(probe.subject)
    named = f"pattern {pattern}; " if pattern != probe.subject else ""
    return (
        f"Redis user {user!r} has no permission for the {kind} {probe.subject!r} "
        f"({named}{probe.command}, needed to {probe.needed_to}); grant {rule}{keys.prefix}:* "
        f"({grant})"
    )


def publish_probe(redis: RedisClient, channel: str, needed_to: str) -> Probe:
    """PUBLISH, or SPUBLISH on a Cluster (as ChannelHub's subscribers listen), to a channel
    nobody listens on."""
    if isinstance(redis, RedisCluster):
        cluster = redis
        return Probe("SPUBLISH", needed_to, channel, lambda: cluster.spublish(channel, b""))
    return Probe("PUBLISH", needed_to, channel, lambda: redis.publish(channel, b""))


def subscribe_probe(redis: RedisClient, channels: tuple[str, ...], needed_to: str) -> Probe:
    """SUBSCRIBE, or SSUBSCRIBE on a Cluster, through a ChannelHub as the real listeners."""

    async def subscribe() -> object:
        hub = ChannelHub(redis)
        try:
            async with hub.listen(*channels):
                return None
        finally:
            await hub.aclose()

    command = "SSUBSCRIBE" if isinstance(redis, RedisCluster) else "SUBSCRIBE"
    return Probe(command, needed_to, ", ".join(channels), subscribe)


def script_probes(redis: RedisClient, scripts: str) -> list[Probe]:
    """SCRIPT LOAD, then EVALSHA of what it loaded (a script that touches nothing). The
    commands the real scripts call need probes of their own: Redis checks those as well."""
    return [
        Probe(
            "SCRIPT LOAD",
            f"load {scripts} into a server that lacks them",
            "",
            lambda: redis.script_load(_PROBE_SCRIPT),
        ),
        Probe("EVALSHA", f"run {scripts}", "", lambda: redis.evalsha(_PROBE_SHA, 0)),
    ]


def replay_log_probes(redis: RedisClient, log_key: str, appending: str) -> list[Probe]:
    """What the script that appends to a replay log calls (``publish_events``), on a log that
    does not exist; ``appending`` says what the appends are for."""
    return [
        Probe("XADD", appending, log_key, lambda: redis.xadd(log_key, {"seq": 0}, nomkstream=True)),
        Probe(
            "XREVRANGE",
            "number a request's events",
            log_key,
            lambda: redis.xrevrange(log_key, "+", "-", count=1),
        ),
        Probe("EXPIRE", "give replay logs their TTL", log_key, lambda: redis.expire(log_key, 60)),
    ]


def in_one_round_trip(
    redis: RedisClient, *commands: Callable[[Any], object]
) -> Callable[[], Awaitable[object]]:
    """A probe that sends ``commands`` (each adds one to a pipeline) in one round trip, so a
    clean-up among them runs even when an earlier one is refused; it raises that refusal."""

    async def send() -> object:
        async with redis.pipeline(transaction=False) as pipe:
            for command in commands:
                command(pipe)
            results = await pipe.execute(raise_on_error=False)
        for result in results:
            if isinstance(result, NoPermissionError):
                raise result
        return results

    return send
