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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import structlog
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoPermissionError, ResponseError

from protocol.channels import ChannelHub
from protocol.connection import SENTINEL_SCHEME, RedisClient, parse_sentinel_url
from protocol.keys import Keys

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
    """Send every probe; MissingPermission for the first one Redis refuses."""
    for probe in probes(redis, keys, consumer, dead_letter_maxlen):
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
    sharded = isinstance(redis, RedisCluster)

    async def publish() -> object:
        if isinstance(redis, RedisCluster):
            return await redis.spublish(keys.out(token), b"")
        return await redis.publish(keys.out(token), b"")

    async def answer() -> object:
        # The reply list must not outlive the probe: EXPIRE and DEL go in the same round trip,
        # so they run even when RPUSH is refused.
        async with redis.pipeline(transaction=False) as pipe:
            pipe.rpush(reply, b"")
            pipe.expire(reply, 60)
            pipe.delete(reply)
            results = await pipe.execute(raise_on_error=False)
        for result in results:
            if isinstance(result, NoPermissionError):
                raise result
        return results

    async def subscribe() -> object:
        hub = ChannelHub(redis)  # SUBSCRIBE, or SSUBSCRIBE on a Cluster, as the worker's own
        try:
            async with hub.listen(keys.control, keys.control_for(consumer)):
                return None
        finally:
            await hub.aclose()

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
        Probe(
            "XADD",
            "append events to replay logs",
            log_key,
            lambda: redis.xadd(log_key, {"seq": 0}, nomkstream=True),
        ),
        Probe(
            "XREVRANGE",
            "number a request's events",
            log_key,
            lambda: redis.xrevrange(log_key, "+", "-", count=1),
        ),
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
        Probe("EXPIRE", "give replay logs their TTL", log_key, lambda: redis.expire(log_key, 60)),
        Probe("SET", "write the heartbeat", beat, lambda: redis.set(beat, b"", xx=True, px=1000)),
        Probe(
            "PEXPIRE",
            "keep the heartbeat alive while Redis is full",
            beat,
            lambda: redis.pexpire(beat, 1000),
        ),
        Probe("DEL", "remove the heartbeat when stopping", beat, lambda: redis.delete(beat)),
        Probe(
            "SPUBLISH" if sharded else "PUBLISH",
            "stream events to subscribers",
            keys.out(token),
            publish,
        ),
        Probe(
            "SCRIPT LOAD",
            "load the worker's Lua scripts into a server that lacks them",
            "",
            lambda: redis.script_load(_PROBE_SCRIPT),
        ),
        Probe("EVALSHA", "run the worker's Lua scripts", "", lambda: redis.evalsha(_PROBE_SHA, 0)),
        Probe("RPUSH", "answer control commands", reply, answer),
        Probe(
            "SSUBSCRIBE" if sharded else "SUBSCRIBE",
            "receive control commands",
            f"{keys.control}, {keys.control_for(consumer)}",
            subscribe,
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
