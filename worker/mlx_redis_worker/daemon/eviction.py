"""Refusing a Redis that may evict our keys.

Under any ``maxmemory-policy`` but ``noeviction``, Redis drops keys when memory runs out:
``allkeys-*`` may drop the job stream with its consumer group (queued and running jobs vanish
without a dead letter), ``volatile-*`` the keys with a TTL: replay logs (subscribers are told
the request "expired"), attempt fences and abort markers. So the worker reads the policy at
start (on every primary of a Cluster) and refuses to serve unless it is ``noeviction`` or the
operator said otherwise (``allow_eviction``). Under ``noeviction`` a full Redis refuses writes
instead; the worker retries those until memory is freed and loses nothing.
"""

from __future__ import annotations

from typing import Any, Final

import structlog
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from mlx_redis_protocol.connection import RedisClient, as_text

log = structlog.get_logger(__name__)

SAFE_POLICY: Final = "noeviction"


class EvictingRedis(Exception):
    """Redis may evict the worker's keys, and the operator did not allow it."""


async def memory_policies(redis: RedisClient) -> dict[str, str]:
    """``maxmemory-policy`` per server (node name on a Cluster, "" otherwise); empty when
    Redis will not say (INFO refused by an ACL, or a server without INFO)."""
    try:
        if isinstance(redis, RedisCluster):
            # Node by node: asked of several nodes at once, redis-py answers a dict by node,
            # but of a one-master Cluster that master's reply alone.
            await redis.initialize()  # the node list (a no-op once the client knows it)
            replies: dict[str, Any] = {
                node.name: await redis.info("memory", target_nodes=node)
                for node in redis.get_primaries()
            }
        else:
            replies = {"": await redis.info("memory")}
    except ResponseError as exc:
        log.warning(
            "maxmemory_policy_unknown",
            reason=str(exc)[:200],
            hint="Redis did not tell its maxmemory-policy (an ACL user needs +info for this check)",
        )
        return {}
    return {
        node: as_text(info.get("maxmemory_policy", SAFE_POLICY)) for node, info in replies.items()
    }


async def check_eviction_policy(redis: RedisClient, where: str, *, allow: bool) -> None:
    """Raise EvictingRedis (one line for the operator) unless Redis never evicts or ``allow``."""
    evicting = {
        node: policy
        for node, policy in (await memory_policies(redis)).items()
        if policy != SAFE_POLICY
    }
    if not evicting:
        return
    policies = ", ".join(sorted({f"{policy}" for policy in evicting.values()}))
    if allow:
        log.warning("redis_may_evict_allowed", maxmemory_policy=policies, nodes=sorted(evicting))
        return
    raise EvictingRedis(
        f"Redis at {where} may evict keys under memory pressure (maxmemory-policy {policies}), "
        "which can drop the job stream, its consumer group and replay logs: set "
        f"maxmemory-policy {SAFE_POLICY}, or pass --allow-eviction (MLXW_ALLOW_EVICTION=1) "
        "to run anyway"
    )
