"""The channel hub: many channels over one connection, reconnects, nothing left subscribed."""

from __future__ import annotations

import asyncio
import contextlib
import time

from redis.asyncio import Redis

from mlx_redis_protocol.channels import MISSED, ChannelHub, Inbox
from mlx_redis_protocol.connection import RedisClient, connect, publish
from mlx_redis_worker.local_redis import LocalCluster, RedisServer
from tests.support.waiting import run, until


async def _subscribers(admin: Redis, channel: str, sharded: bool = False) -> int:
    command = ("PUBSUB", "SHARDNUMSUB") if sharded else ("PUBSUB", "NUMSUB")
    reply = await admin.execute_command(*command, channel)  # type: ignore[no-untyped-call]
    counts = reply if isinstance(reply, list) else [item for pair in reply.items() for item in pair]
    return int(counts[1])


async def _next(inbox: Inbox, timeout: float = 5) -> bytes | None:
    return await asyncio.wait_for(inbox.get(), timeout)


def test_listeners_share_subscriptions_and_the_last_one_out_unsubscribes(redis_url: str) -> None:
    async def scenario() -> tuple[list[bytes | None], int, int, int]:
        redis = await connect(redis_url)
        admin = Redis.from_url(redis_url)
        hub = ChannelHub(redis)
        try:
            async with hub.listen("hub:a", "hub:b") as both, hub.listen("hub:a") as only_a:
                await publish(redis, "hub:a", b"1")
                await publish(redis, "hub:b", b"2")
                got = [await _next(both), await _next(both), await _next(only_a)]
                subscribed = hub.channels
                connections = [c for c in await admin.client_list() if int(c.get("sub", 0)) > 0]
            await until(
                lambda: _no_subscribers(admin, "hub:a", "hub:b"), 5, "both channels unsubscribed"
            )
            return got, subscribed, len(connections), hub.channels
        finally:
            await hub.aclose()
            await redis.aclose()
            await admin.aclose()

    got, subscribed, connections, left = run(scenario())
    assert sorted(got[:2]) == [b"1", b"2"] and got[2] == b"1"  # type: ignore[type-var]
    assert subscribed == 2
    assert connections == 1  # one pub/sub connection for every channel and listener
    assert left == 0


async def _no_subscribers(admin: Redis, *channels: str) -> bool:
    counts = [await _subscribers(admin, channel) for channel in channels]
    return not any(counts)


def test_a_restarted_redis_gives_missed_then_live_messages_and_drops_orphans() -> None:
    """Redis restarts under the hub: its listener gets MISSED once the connection is back
    (so it re-reads what it may have missed) and live messages again. A listener that left
    while Redis was down could not unsubscribe; redis-py subscribed its channel again on
    reconnect, and the hub drops that orphan by itself."""
    server = RedisServer()
    server.start()

    async def scenario() -> tuple[bytes | None, bytes | None, int]:
        redis = await connect(server.url, socket_timeout=2)
        hub = ChannelHub(redis)
        try:
            async with hub.listen("hub:stays") as stays:
                async with hub.listen("hub:leaves"):
                    server.stop()
                    await asyncio.sleep(0.3)
                # left while Redis was down; now it comes back on the same port
                server.start()
                missed = await _next(stays, timeout=10)
                await until(lambda: _delivered(redis, "hub:stays"), 5, "re-subscription")
                live = await _next(stays)
                admin = Redis.from_url(server.url)
                try:
                    await until(
                        lambda: _no_subscribers(admin, "hub:leaves"), 5, "the orphan dropped"
                    )
                    still = await _subscribers(admin, "hub:stays")
                finally:
                    await admin.aclose()
                return missed, live, still
        finally:
            await hub.aclose()
            await redis.aclose()

    try:
        missed, live, still = run(scenario())
    finally:
        server.close()
    assert missed is MISSED
    assert live == b"back"
    assert still == 1


async def _delivered(redis: RedisClient, channel: str) -> bool:
    with contextlib.suppress(Exception):
        return await publish(redis, channel, b"back") > 0
    return False


def test_shard_channels_on_every_cluster_node_through_one_hub(redis_cluster: LocalCluster) -> None:
    """On a Cluster each channel lives on the node owning its slot: the hub subscribes with
    SSUBSCRIBE there and reads every node it uses."""
    channels = [f"hub:{{{index}}}" for index in range(12)]

    async def scenario() -> tuple[set[bytes | None], int, int]:
        redis = await connect(redis_cluster.url)
        hub = ChannelHub(redis)
        try:
            nodes = {redis.get_node_from_key(c).name for c in channels}  # type: ignore[union-attr]
            async with hub.listen(*channels) as inbox:
                for channel in channels:
                    assert await publish(redis, channel, channel.encode()) == 1
                got = {await _next(inbox) for _ in channels}
            # Left: a message on any of the channels reaches nobody. (SPUBLISH's count, not
            # PUBSUB SHARDNUMSUB, whose reply redis-py 8's Cluster client fails to parse.)
            remaining = 0
            for channel in channels:
                remaining += await publish(redis, channel, b"after")
            return got, len(nodes), remaining
        finally:
            await hub.aclose()
            await redis.aclose()

    got, nodes, remaining = run(scenario())
    assert got == {channel.encode() for channel in channels}
    assert nodes == len(redis_cluster.nodes)
    assert remaining == 0


def test_listeners_join_and_leave_at_once_on_cluster_nodes_already_read(
    redis_cluster: LocalCluster,
) -> None:
    """A listener joining a Cluster node whose reader already waits for messages is
    subscribed without waiting for that read to end, and so is the next one (a client that
    starts following 40 requests at once, then one more, waited 8 s for the last)."""
    warm = [f"hub:warm:{{{index}}}" for index in range(12)]

    async def scenario() -> tuple[float, float]:
        redis = await connect(redis_cluster.url)
        hub = ChannelHub(redis)
        try:
            async with hub.listen(*warm):  # a reader waits on every node now
                await asyncio.sleep(0.3)
                started = time.monotonic()
                async with contextlib.AsyncExitStack() as stack:
                    for index in range(30):
                        await stack.enter_async_context(hub.listen(f"hub:join:{{{index}}}"))
                joined_and_left = time.monotonic() - started
                async with hub.listen("hub:last:{0}") as inbox:
                    await publish(redis, "hub:last:{0}", b"live")
                    started = time.monotonic()
                    assert await _next(inbox) == b"live"
                    delivered = time.monotonic() - started
            return joined_and_left, delivered
        finally:
            await hub.aclose()
            await redis.aclose()

    joined_and_left, delivered = run(scenario())
    # A bounded poll of the node held its lock: each join and leave waited for up to _READ_WAIT
    # (30 joins and leaves took 25 s); now each is one round trip.
    assert joined_and_left < 3.0, joined_and_left
    assert delivered < 1.0, delivered
