"""Running the project's Lua scripts by their SHA1 (``EVALSHA``), not their text.

``run_script`` and ``run_script_each`` load a script where a server lacks it (``NOSCRIPT``: a
restarted server, a failed-over master, a Cluster node that never ran it) and send the call
again. A call answered NOSCRIPT did not run, so sending it again is always safe.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, TypeVar

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError, TryAgainError
from redis.typing import EncodableT, KeyT

from mlx_redis_protocol.connection import RedisClient, refresh_slot_map

# What a Cluster node answers a script that reached a key of a slot it no longer serves
# (a failover or a resharding moved the slot since the caller read the slot map).
NOT_LOCAL: Final = "non local key"

# One script call as a sender takes it: ``(keys, args)``, or ``(node, args)`` on a Cluster.
CallT = TypeVar("CallT")

# redis-py's script object per client and script (its SHA1 computed once), dropped with the
# client: nothing is shared between clients, which may talk to different servers.
_scripts: weakref.WeakKeyDictionary[RedisClient, dict[str, AsyncScript]] = (
    weakref.WeakKeyDictionary()
)


def registered_script(redis: RedisClient, script: str) -> AsyncScript:
    """``redis.register_script(script)``, made once per client."""
    by_text = _scripts.setdefault(redis, {})
    if script not in by_text:
        by_text[script] = redis.register_script(script)
    return by_text[script]


async def run_script(
    redis: RedisClient, script: str, keys: Sequence[KeyT], args: Sequence[EncodableT]
) -> Any:
    """One call of a Lua script by its SHA1; redis-py loads it (SCRIPT LOAD) where missing."""
    return await registered_script(redis, script)(keys, args)


async def run_script_each(
    redis: RedisClient,
    script: str,
    calls: Sequence[tuple[Sequence[KeyT], Sequence[EncodableT]]],
) -> list[Any]:
    """Several calls of one Lua script (``(keys, args)`` each) in one round trip: a pipeline,
    on a Cluster split per node and sent to them in parallel. Every call must have keys.

    redis-py's script objects load a missing script only for a single server's pipeline, and
    then ask SCRIPT EXISTS before every execute (a second round trip); on a Cluster its
    pipeline refuses ``evalsha()`` outright. So here the calls answered NOSCRIPT are sent
    again once, after SCRIPT LOAD on the nodes that answered so.
    """
    sha = registered_script(redis, script).sha
    replies = await _sent_again_where_missing(
        calls,
        lambda batch: _evalsha_pipelined(redis, sha, batch),
        lambda batch: _load_script(redis, script, [keys for keys, _ in batch]),
    )
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


async def _sent_again_where_missing(
    calls: Sequence[CallT],
    send: Callable[[Sequence[CallT]], Awaitable[list[Any]]],
    load: Callable[[Sequence[CallT]], Awaitable[object]],
) -> list[Any]:
    """``send(calls)``'s replies (errors as exceptions, not raised); the calls answered
    NOSCRIPT are sent again once, after ``load`` put the script where they go."""
    replies = await send(calls)
    missing = [index for index, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:
        again = [calls[index] for index in missing]
        await load(again)
        for index, reply in zip(missing, await send(again), strict=True):
            replies[index] = reply
    return replies


async def _evalsha_pipelined(
    redis: RedisClient, sha: str, calls: Sequence[tuple[Sequence[KeyT], Sequence[EncodableT]]]
) -> list[Any]:
    """The replies, errors included (as exceptions, not raised).

    On a Cluster each call names its node (its first key's): redis-py's pipeline would
    otherwise resolve the command's routing policy and hash every key of every call (to
    check they share a slot) before sending, the largest share of a worker's CPU per
    streamed token after packing. A call the node answers MOVED is still redirected."""
    async with redis.pipeline(transaction=False) as pipe:
        for keys, args in calls:
            # By name: redis-py blocks pipe.evalsha() on a Cluster (see run_script_each).
            if isinstance(redis, RedisCluster):
                node = redis.get_node_from_key(_name(keys[0]))
                pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args, target_nodes=node)
            else:
                pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
    return replies


def _name(key: KeyT) -> str:
    """A key as redis-py's slot lookup is typed to take it (callers may pass keys encoded)."""
    return key if isinstance(key, str) else bytes(key).decode()


async def _load_script(redis: RedisClient, script: str, keys: Sequence[Sequence[KeyT]]) -> None:
    """SCRIPT LOAD on the server, or on the Cluster nodes that own these calls' keys."""
    if not isinstance(redis, RedisCluster):
        await redis.script_load(script)
        return
    nodes: set[ClusterNode] = set()
    for call_keys in keys:
        node = redis.get_node_from_key(_name(call_keys[0]))
        if node is not None:
            nodes.add(node)
    await redis.execute_command("SCRIPT LOAD", script, target_nodes=list(nodes))


async def run_script_on_nodes(
    redis: RedisCluster,
    script: str,
    calls: Sequence[tuple[ClusterNode, Sequence[EncodableT]]],
) -> list[Any]:
    """Calls of a script that declares no keys, each on its node (``(node, args)``), in one
    round trip to the nodes in parallel: a script flagged ``allow-cross-slot-keys`` that
    reaches keys of several slots of its node, named in its arguments (Redis runs a call
    with declared keys only when they share one slot).

    A node missing the script is loaded it and the calls it answered NOSCRIPT are sent again,
    as ``run_script_each`` does. A node that no longer serves a key a call reaches answers an
    error after running the call up to that key: the slot map is read again and TryAgainError
    raised (Redis unavailable for now), so the caller's retry, which such a script must
    allow, goes to the key's node."""
    sha = registered_script(redis, script).sha
    replies = await _sent_again_where_missing(
        calls,
        lambda batch: _evalsha_on_nodes(redis, sha, batch),
        lambda batch: redis.execute_command(
            "SCRIPT LOAD", script, target_nodes=list({node for node, _ in batch})
        ),
    )
    for reply in replies:
        if isinstance(reply, ResponseError) and NOT_LOCAL in str(reply):
            await refresh_slot_map(redis)
            raise TryAgainError(f"a key moved to another node: {reply}")
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


async def _evalsha_on_nodes(
    redis: RedisCluster, sha: str, calls: Sequence[tuple[ClusterNode, Sequence[EncodableT]]]
) -> list[Any]:
    async with redis.pipeline(transaction=False) as pipe:
        for node, args in calls:
            pipe.execute_command("EVALSHA", sha, 0, *args, target_nodes=node)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
    return replies
