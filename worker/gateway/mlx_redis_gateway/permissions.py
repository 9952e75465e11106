"""Every Redis command the gateway needs, tried once before it listens (as the worker does:
see mlx_redis_worker.daemon.permissions), so a grant missing from its ACL user stops it at start
with one line, rather than turning the first request that needs the command into a 500.

The probes touch keys and channels of a request id and API key name nobody uses, shaped like
the real ones (hash tags included, so a Cluster routes each to its node), and change nothing.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable

from mlx_redis_gateway.fleet_status import read_fleet_status
from mlx_redis_protocol.catalogue import served_models
from mlx_redis_protocol.connection import RedisClient, connect
from mlx_redis_protocol.control import MIN_BLPOP_TIMEOUT
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.permissions import (
    Probe,
    check_probes,
    in_one_round_trip,
    publish_probe,
    redis_user,
    replay_log_probes,
    script_probes,
    subscribe_probe,
)
from mlx_redis_protocol.redis_retry import retry_until_done


async def check_gateway_permissions(
    url: str, topology: str, keys: Keys, *, status_page: bool, limits: bool
) -> None:
    """Connect and send every probe; MissingPermission for the first one Redis refuses, a
    REFUSED error for a login it refuses. While Redis cannot be reached it keeps trying (a
    gateway may start before its Redis does), logging the outage."""

    async def check() -> None:
        redis = await connect(url, topology=topology)
        try:
            probes = gateway_probes(redis, keys, status_page=status_page, limits=limits)
            await check_probes(probes, redis_user(url), keys)
        finally:
            await redis.aclose()

    await retry_until_done(check, "check the gateway's Redis permissions")


def gateway_probes(
    redis: RedisClient, keys: Keys, *, status_page: bool, limits: bool
) -> list[Probe]:
    """The probes of a gateway: with ``status_page``, the status page's reads; with
    ``limits`` (API keys), the commands of the quota scripts."""
    token = f"permission-probe-{secrets.token_hex(6)}"
    record, log_key, reply = keys.gateway_request(token), keys.log(token), keys.reply(token)
    stored = keys.stored_response(token, "resp_probe")
    probes = [
        Probe(
            "ZRANGE",  # and GET of each registered worker's heartbeat
            "find the models live workers serve",
            keys.workers,
            lambda: served_models(redis, keys),
        ),
        *script_probes(redis, "the gateway's Lua scripts"),
        Probe(
            "XADD",
            "queue jobs",
            keys.jobs,
            # An id of 0-0 is always refused, after the ACL check: nothing is appended.
            lambda: redis.xadd(keys.jobs, {"probe": b""}, id="0-0", nomkstream=True),
        ),
        *replay_log_probes(redis, log_key, "write a request's queued marker"),
        publish_probe(redis, keys.out(token), "announce requests and abort jobs"),
        subscribe_probe(redis, (keys.out(token),), "follow a request's events"),
        Probe(
            "XRANGE",
            "read a request's events",
            log_key,
            lambda: redis.xrange(log_key, count=1),
        ),
        Probe(
            "PTTL",
            "tell a log Redis lost from one that expired",
            log_key,
            lambda: redis.pttl(log_key),
        ),
        Probe(
            "SET",
            "keep what resuming a request needs",
            record,
            lambda: redis.set(record, b"", xx=True, ex=60),
        ),
        Probe("GET", "resume a request", record, lambda: redis.get(record)),
        Probe(
            "GET",
            "continue from a stored response (previous_response_id)",
            stored,
            lambda: redis.get(stored),
        ),
        Probe(
            "SET",
            "abort the job of a client that went away",
            keys.abort(token),
            lambda: redis.set(keys.abort(token), b"", xx=True, ex=60),
        ),
        Probe(
            "BLPOP",
            "hear the workers' answers to an abort",
            reply,
            lambda: redis.blpop([reply], timeout=MIN_BLPOP_TIMEOUT),
        ),
    ]
    if status_page:
        probes.append(
            Probe(
                "XINFO GROUPS",  # and what else Redis names: XLEN, XPENDING, XREVRANGE, GET
                "show the fleet's status",
                keys.jobs,
                lambda: read_fleet_status(redis, keys),
            )
        )
    if limits:
        probes += _quota_probes(redis, keys, token)
    return probes


def _quota_probes(redis: RedisClient, keys: Keys, name: str) -> list[Probe]:
    """The commands the quota scripts call (Redis checks each inside a script as well), on
    the buckets of an API key name nobody has."""
    bucket, leases = keys.quota(name), keys.quota_in_flight(name)

    def probe(command: str, key: str, send: Callable[[], Awaitable[object]]) -> Probe:
        return Probe(command, "enforce the API keys' limits", key, send)

    return [
        probe("TIME", "", redis.time),
        probe("ZREMRANGEBYSCORE", leases, lambda: redis.zremrangebyscore(leases, "-inf", 0)),
        probe("ZCARD", leases, lambda: redis.zcard(leases)),
        probe("ZSCORE", leases, lambda: redis.zscore(leases, "probe")),
        # XX: only members that exist are updated, and there are none.
        probe("ZADD", leases, lambda: redis.zadd(leases, {"probe": 0}, xx=True)),
        probe("ZREM", leases, lambda: redis.zrem(leases, "probe")),
        probe("PEXPIRE", leases, lambda: redis.pexpire(leases, 1000)),
        probe("HMGET", bucket, lambda: redis.hmget(bucket, ["tokens", "at"])),
        # HSET creates the hash, which the DEL removes.
        probe(
            "HSET",
            bucket,
            in_one_round_trip(
                redis,
                lambda pipe: pipe.hset(bucket, "probe", b""),
                lambda pipe: pipe.delete(bucket),
            ),
        ),
    ]
