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

import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from mlx_redis_protocol.connection import RedisClient
from mlx_redis_protocol.keys import JobStream, Keys
from mlx_redis_protocol.permissions import (
    Probe,
    check_probes,
    in_one_round_trip,
    publish_probe,
    replay_log_probes,
    script_probes,
    subscribe_probe,
)

# Past any real stream id (milliseconds since 1970), yet not the largest id, which XREADGROUP
# does not treat as a position in the history: it delivers new entries instead.
_FAR_FUTURE_ID = "9999999999999999-0"
# An id no producer writes (they let Redis choose: milliseconds since 1970).
_NO_SUCH_ENTRY = "0-1"
# Longer than any entry can have been idle: XCLAIM / XAUTOCLAIM take nothing.
_NEVER_IDLE_MS = 2**62


async def check_permissions(
    redis: RedisClient,
    keys: Keys,
    consumer: str,
    user: str,
    dead_letter_maxlen: int,
    fair_models: tuple[str, ...] = (),
    models: Sequence[str] = (),
) -> None:
    """Send the worker's probes (with those of fair share for ``fair_models``, the models it
    serves with fair share on); MissingPermission for the first one Redis refuses."""
    every = probes(redis, keys, consumer, dead_letter_maxlen, models)
    for model in fair_models:
        every += fair_share_probes(redis, keys, model)
    await check_probes(every, user, keys)


def fair_share_probes(redis: RedisClient, keys: Keys, model: str) -> list[Probe]:
    """The commands of the fair pick script and of the weights' copy, on keys of the model's
    fair-share state that nobody uses (a probe tenant's queue), in the stream's slot. Each
    one that would write is undone in the same round trip."""
    fair = keys.fair(model)
    stream = keys.model_stream(model).stream
    queue = fair.queue(f"permission-probe-{secrets.token_hex(6)}")
    needed = "pick jobs by fair share"

    def undone(command: Callable[[Any], object]) -> Callable[[], Awaitable[object]]:
        return in_one_round_trip(redis, command, lambda pipe: pipe.delete(queue))

    return [
        Probe(
            "XREAD",
            "wait for new jobs (fair share)",
            stream,
            lambda: redis.xread({stream: _FAR_FUTURE_ID}, count=1),
        ),
        Probe(
            "XINFO CONSUMERS",
            "reclaim jobs of workers that died, not those waiting for a pick",
            stream,
            lambda: redis.xinfo_consumers(stream, keys.group),
        ),
        Probe("ZADD", needed, queue, undone(lambda pipe: pipe.zadd(queue, {"probe": 0}))),
        Probe("ZINCRBY", needed, queue, undone(lambda pipe: pipe.zincrby(queue, 1, "probe"))),
        Probe("ZRANGE", needed, queue, lambda: redis.zrange(queue, 0, 0)),
        Probe("ZSCORE", needed, queue, lambda: redis.zscore(queue, "probe")),
        Probe("ZREM", needed, queue, lambda: redis.zrem(queue, "probe")),
        Probe("ZCARD", "report tenants' waiting jobs", queue, lambda: redis.zcard(queue)),
        Probe("ZREMRANGEBYSCORE", needed, queue, lambda: redis.zremrangebyscore(queue, 0, -1)),
        Probe("HGET", needed, queue, lambda: redis.hget(queue, "probe")),
        Probe("HGETALL", "read tenant weights", queue, lambda: redis.hgetall(queue)),
        Probe("HLEN", "copy tenant weights", queue, lambda: redis.hlen(queue)),
        Probe("TYPE", "repair fair-share keys of another type", queue, lambda: redis.type(queue)),
        Probe(
            "ZREMRANGEBYRANK",
            "forget idle tenants",
            queue,
            lambda: redis.zremrangebyrank(queue, 1, 0),
        ),
        Probe("HDEL", "copy tenant weights", queue, lambda: redis.hdel(queue, "probe")),
        Probe("HSET", "copy tenant weights", queue, undone(lambda pipe: pipe.hset(queue, "p", 1))),
        Probe(
            "HINCRBY", "count tokens served", queue, undone(lambda pipe: pipe.hincrby(queue, "p"))
        ),
    ]


def probes(
    redis: RedisClient,
    keys: Keys,
    consumer: str,
    dead_letter_maxlen: int,
    models: Sequence[str] = (),
) -> list[Probe]:
    """The probes, each stream's group creation first (the others use the group): the
    default stream's, then each served model's (``models``), whose keys are patterns of
    their own (a user granted ``~mlxw:jobs`` alone cannot read ``mlxw:jobs:{MODEL}``). The
    other keys and channels are the real kinds' names for a request id, worker id, entry id
    and reply token nobody uses, so they do not exist (and nobody listens on the channel); the
    job streams, their groups and dead-letter streams are the real ones. A refusal names the
    key table's pattern of the probe's key (``Keys.pattern_of``), so it says which line of an
    ACL is missing."""
    token = f"permission-probe-{secrets.token_hex(6)}"
    log_key, attempt, finished, abort, beat, claim, activity, reply = (
        keys.log(token),
        keys.attempt(token),
        keys.finished(token),
        keys.abort(token),
        keys.worker(token),
        keys.claim(token),
        keys.activity(token),
        keys.reply(token),
    )
    found = [
        *_stream_probes(redis, keys.default_stream, consumer, token, dead_letter_maxlen),
        *(
            probe
            for model in models
            for probe in _stream_probes(
                redis, keys.model_stream(model), consumer, token, dead_letter_maxlen
            )
        ),
        *(_forwarded_probe(redis, keys, model) for model in models),
        *replay_log_probes(redis, log_key, "append events to replay logs"),
        Probe(
            "GET",
            "check which attempt may write a request's events",
            attempt,
            lambda: redis.get(attempt),
        ),
        Probe(
            "SET",
            "fence a request's attempt",
            attempt,
            lambda: redis.set(attempt, b"", xx=True),
        ),
        Probe(
            "SET",
            "remember finished requests (the idempotency window)",
            finished,
            lambda: redis.set(finished, b"", xx=True, ex=60),
        ),
        Probe(
            "GET",
            "read abort markers",
            abort,
            lambda: redis.get(abort),
        ),
        Probe(
            "SET",
            "mark aborted requests",
            abort,
            lambda: redis.set(abort, b"", xx=True, ex=60),
        ),
        Probe(
            "SET",
            "write the heartbeat",
            beat,
            lambda: redis.set(beat, b"", xx=True, px=1000),
        ),
        Probe(
            "PEXPIRE",
            "keep the heartbeat alive while Redis is full",
            beat,
            lambda: redis.pexpire(beat, 1000),
        ),
        Probe(
            "EXISTS",
            "see whether the heartbeat lived (the claim's script, with each heartbeat)",
            beat,
            lambda: redis.exists(beat),
        ),
        Probe(
            "DEL",
            "remove the heartbeat when stopping",
            beat,
            lambda: redis.delete(beat),
        ),
        *_registry_probes(redis, keys, token),
        Probe(
            "SET",
            "claim the worker id (its scripts: GET, SET, DEL, EXISTS, PEXPIRE)",
            claim,
            lambda: redis.set(claim, b"", xx=True, px=1000),
        ),
        Probe(
            "SET",
            "write the activity key (status page)",
            activity,
            lambda: redis.set(activity, b"", xx=True, px=1000),
        ),
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
    ]
    return found


def _stream_probes(
    redis: RedisClient, stream: JobStream, consumer: str, token: str, dead_letter_maxlen: int
) -> list[Probe]:
    """What the worker sends to one job stream, its group and its dead-letter stream."""
    jobs, group, dead = stream.stream, stream.group, stream.dead
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
        Probe(
            "XDEL",
            "delete finished jobs",
            jobs,
            lambda: redis.xdel(jobs, _NO_SUCH_ENTRY),
        ),
        Probe(
            "XADD",
            "dead-letter jobs that can never run",
            dead,
            # The real dead-letter stream: an id of 0-0 is always refused, after the ACL check.
            lambda: redis.xadd(
                dead,
                {"probe": b""},
                id="0-0",
                maxlen=dead_letter_maxlen,
                approximate=True,
                nomkstream=True,
            ),
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


def _registry_probes(redis: RedisClient, keys: Keys, token: str) -> list[Probe]:
    """The commands of the registration script (and of leaving the registry), on a member
    nobody has: ``ZADD XX`` adds nothing, an empty score range removes nothing."""
    workers, models = keys.workers, keys.models
    needed = "register in the fleet's registry (catalogue, reply counting)"
    return [
        Probe("TIME", needed, workers, lambda: redis.time()),
        Probe("ZADD", needed, workers, lambda: redis.zadd(workers, {token: 0}, xx=True)),
        Probe("ZADD", needed, models, lambda: redis.zadd(models, {token: 0}, xx=True)),
        Probe(
            "ZREMRANGEBYSCORE",
            "drop workers that died from the registry",
            workers,
            lambda: redis.zremrangebyscore(workers, 1, 0),
        ),
        Probe(
            "ZREM", "leave the registry when stopping", workers, lambda: redis.zrem(workers, token)
        ),
        Probe("ZCARD", "count the fleet's workers", workers, lambda: redis.zcard(workers)),
    ]


def _forwarded_probe(redis: RedisClient, keys: Keys, model: str) -> Probe:
    """The marker the forwarding script sets (``SET NX EX``) before it appends a job of the
    default stream to the model's stream; XX here: it never creates one."""
    marker = keys.forwarded(model, _NO_SUCH_ENTRY)
    return Probe(
        "SET",
        "forward jobs of the default stream to a model's stream",
        marker,
        lambda: redis.set(marker, b"", xx=True, ex=60),
    )
