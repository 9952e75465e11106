"""Every Redis command the worker needs, tried once at start so a missing ACL grant fails fast.

Redis checks an ACL user's rights per command, key and channel when a command runs, also for
each command a Lua script calls. A user without, say, ``+xautoclaim`` lets the worker start
and serve; the reclaim task then fails later, in a log line nobody reads, and jobs of workers
that died are never run. So after connecting, before the model load, the worker sends each
command it will ever send (directly or from its scripts) once, on keys and channels of its own
prefix shaped like the real ones (hash tags included, so a Cluster routes each to its node),
with arguments that change nothing, and stops with one line naming the first one refused.

Redis checks the ACL before it looks at a command's arguments, so any reply other than
``NOPERM`` means the command is allowed, an error about the arguments included; some probes
rely on that (``XADD … 0-0`` is always refused as an ID, never appended).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import structlog
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoPermissionError, ResponseError

from mlx_redis_protocol.channels import ChannelHub
from mlx_redis_protocol.connection import SENTINEL_SCHEME, RedisClient, parse_sentinel_url
from mlx_redis_protocol.keys import Keys

log = structlog.get_logger(__name__)

# Past any real stream id (milliseconds since 1970), yet not the largest id, which XREADGROUP
# does not treat as a position in the history: it delivers new entries instead.
_FAR_FUTURE_ID = "9999999999999999-0"
# An id no producer writes (they let Redis choose: milliseconds since 1970).
_NO_SUCH_ENTRY = "0-1"
# Longer than any entry can have been idle: XCLAIM / XAUTOCLAIM take nothing.
_NEVER_IDLE_MS = 2**62
_COMMAND_REFUSED = re.compile(r"run the '([^']+)' command")
# The Lua probe: it touches nothing. Loading it first makes the EVALSHA probe run it rather
# than answer NOSCRIPT (on a Cluster, SCRIPT LOAD reaches every master).
_PROBE_SCRIPT = "return 1"
_PROBE_SHA = hashlib.sha1(_PROBE_SCRIPT.encode()).hexdigest()


class MissingPermission(Exception):
    """Redis refuses the worker's user a command, key or channel it needs (one line)."""


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


async def check_permissions(
    redis: RedisClient, keys: Keys, consumer: str, user: str, dead_letter_maxlen: int
) -> None:
    """Send the worker's probes; MissingPermission for the first one Redis refuses."""
    await check_probes(probes(redis, keys, consumer, dead_letter_maxlen), user, keys)


async def check_probes(probes: Iterable[Probe], user: str, keys: Keys) -> None:
    """Send each probe in turn; MissingPermission for the first one Redis refuses."""
    for probe in probes:
        try:
            await probe.send()
        except NoPermissionError as exc:
            raise MissingPermission(refusal(user, keys, probe, exc)) from exc
        except ResponseError:
            pass  # allowed: only the arguments were refused (see the module docstring)
    log.debug("redis_permissions_checked", user=user)


def refusal(user: str, keys: Keys, probe: Probe, exc: NoPermissionError) -> str:
    """The operator's line for a refused probe: which command, key or channel, and why the
    worker needs it. Redis names the command it refused (a pipeline's or script's may differ
    from the probe's); for a key or a channel it only says which kind."""
    text = str(exc)
    grant = "see README: minimum ACL"
    if (command := _COMMAND_REFUSED.search(text)) is not None:
        name = command.group(1).replace("|", " ").upper()
        return (
            f"Redis user {user!r} may not run {name} (needed to {probe.needed_to}); "
            f"grant it ({grant})"
        )
    kind, pattern = ("channel", "&") if "channel" in text else ("key", "~")
    return (
        f"Redis user {user!r} has no permission for the {kind} {probe.subject!r} "
        f"({probe.command}, needed to {probe.needed_to}); grant {pattern}{keys.prefix}:* "
        f"({grant})"
    )


def probes(redis: RedisClient, keys: Keys, consumer: str, dead_letter_maxlen: int) -> list[Probe]:
    """The probes, the group's creation first (the others use the group). Their keys and
    channels are the real kinds' names for a request id, worker id and reply token nobody
    uses, so they do not exist (and nobody listens on the channel); the job stream, its group
    and the dead-letter stream are the real ones."""
    token = f"permission-probe-{secrets.token_hex(6)}"
    jobs, group = keys.jobs, keys.group
    log_key, attempt, abort, beat, reply = (
        keys.log(token),
        keys.attempt(token),
        keys.abort(token),
        keys.worker(token),
        keys.reply(token),
    )

    return [
        Probe(
            "XGROUP CREATE",
            "create the consumer group",
            jobs,
            # What the worker's start does anyway (BUSYGROUP, when it exists, is an allowed no).
            lambda: redis.xgroup_create(jobs, group, id="0", mkstream=True),
        ),
        Probe(
            "XREADGROUP",
            "read jobs",
            jobs,
            # Its own pending entries after a far-future id: none, and no delivery counted.
            lambda: redis.xreadgroup(group, consumer, {jobs: _FAR_FUTURE_ID}, count=1),
        ),
        Probe(
            "XPENDING",
            "count a job's deliveries and check that it is still this worker's",
            jobs,
            lambda: redis.xpending_range(jobs, group, "-", "+", 1, consumername=consumer),
        ),
        Probe(
            "XAUTOCLAIM",
            "reclaim jobs of workers that died",
            jobs,
            lambda: redis.xautoclaim(jobs, group, consumer, _NEVER_IDLE_MS, count=1, justid=True),
        ),
        Probe(
            "XCLAIM",
            "keep the leases of running jobs",
            jobs,
            lambda: redis.xclaim(
                jobs, group, consumer, _NEVER_IDLE_MS, [_NO_SUCH_ENTRY], justid=True
            ),
        ),
        Probe(
            "XACK",
            "acknowledge finished jobs",
            jobs,
            lambda: redis.xack(jobs, group, _NO_SUCH_ENTRY),
        ),
        Probe("XDEL", "delete finished jobs", jobs, lambda: redis.xdel(jobs, _NO_SUCH_ENTRY)),
        Probe(
            "XADD",
            "dead-letter jobs that can never run",
            keys.dead,
            # The real dead-letter stream: an id of 0-0 is always refused, after the ACL check.
            lambda: redis.xadd(
                keys.dead,
                {"probe": b""},
                id="0-0",
                maxlen=dead_letter_maxlen,
                approximate=True,
                nomkstream=True,
            ),
        ),
        *replay_log_probes(redis, log_key, "append events to replay logs"),
        Probe(
            "GET",
            "check which attempt may write a request's events",
            attempt,
            lambda: redis.get(attempt),
        ),
        Probe(
            "SET", "fence a request's attempt", attempt, lambda: redis.set(attempt, b"", xx=True)
        ),
        Probe("EXISTS", "check abort markers", abort, lambda: redis.exists(abort)),
        Probe("SET", "mark aborted requests", abort, lambda: redis.set(abort, b"", xx=True, ex=60)),
        Probe("SET", "write the heartbeat", beat, lambda: redis.set(beat, b"", xx=True, px=1000)),
        Probe(
            "PEXPIRE",
            "keep the heartbeat alive while Redis is full",
            beat,
            lambda: redis.pexpire(beat, 1000),
        ),
        Probe("DEL", "remove the heartbeat when stopping", beat, lambda: redis.delete(beat)),
        publish_probe(redis, keys.out(token), "stream events to subscribers"),
        *script_probes(redis, "the worker's Lua scripts"),
        Probe(
            "RPUSH",
            "answer control commands",
            reply,
            # The reply list must not outlive the probe.
            in_one_round_trip(
                redis,
                lambda pipe: pipe.rpush(reply, b""),
                lambda pipe: pipe.expire(reply, 60),
                lambda pipe: pipe.delete(reply),
            ),
        ),
        subscribe_probe(
            redis, (keys.control, keys.control_for(consumer)), "receive control commands"
        ),
        Probe(
            "XINFO GROUPS",
            "report the group's lag and pending count (stats, metrics)",
            jobs,
            lambda: redis.xinfo_groups(jobs),
        ),
        Probe(
            "XGROUP DELCONSUMER",
            "leave the consumer group when stopping",
            jobs,
            # A consumer name nobody has: deleting it deletes nothing.
            lambda: redis.xgroup_delconsumer(jobs, group, token),
        ),
    ]


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
