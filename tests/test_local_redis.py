"""The local Redis set-ups against real servers: a cluster, a Sentinel failover, one server."""

from __future__ import annotations

import asyncio
import socket

import pytest
import redis
import redis.asyncio.cluster
import redis.cluster
import redis.sentinel

from mlx_redis_worker.daemon.eviction import memory_policies
from mlx_redis_worker.local_redis import LocalCluster, LocalSentinel, RedisServer, free_port_pair
from mlx_redis_worker.local_redis.probe import connect


def test_cluster_covers_every_slot_and_serves_keys_on_every_node(
    redis_cluster: LocalCluster,
) -> None:
    assert len(redis_cluster.nodes) == 3
    for node in redis_cluster.nodes:
        with connect(node.port) as client:
            info = client.cluster("INFO")
        assert info["cluster_state"] == "ok"
        assert info["cluster_slots_ok"] == "16384"
    cluster_client = redis.cluster.RedisCluster.from_url(redis_cluster.url, decode_responses=True)
    try:
        keys = [f"test-local-redis:{index}" for index in range(30)]
        owners = {key: cluster_client.get_node_from_key(key).port for key in keys}
        assert set(owners.values()) == {node.port for node in redis_cluster.nodes}
        for key in keys:
            cluster_client.set(key, key.upper())
        for key in keys:
            assert cluster_client.get(key) == key.upper()
    finally:
        cluster_client.close()
    # Each key really lives where the cluster client sent it.
    for key, port in owners.items():
        with connect(port) as direct:
            assert direct.get(key) == key.upper()


def test_a_one_master_cluster_serves_every_slot_and_tells_its_memory_policy(
    redis_cluster: LocalCluster,
) -> None:
    """The baseline a Cluster's scaling is measured against; redis-py answers a question put
    to its one master without the by-node dict it gives for several, and the worker's
    eviction check (which starts every worker) reads both shapes."""

    async def policies(url: str) -> dict[str, str]:
        client = redis.asyncio.cluster.RedisCluster.from_url(url)
        try:
            return await memory_policies(client)
        finally:
            await client.aclose()

    with LocalCluster(masters=1) as lone:
        with connect(lone.nodes[0].port) as client:
            info = client.cluster("INFO")
        assert (info["cluster_state"], info["cluster_slots_ok"]) == ("ok", "16384")
        assert list(asyncio.run(policies(lone.url)).values()) == ["noeviction"]
    assert list(asyncio.run(policies(redis_cluster.url)).values()) == ["noeviction"] * 3
    with pytest.raises(ValueError, match="1 master"):
        LocalCluster(masters=2)


def test_cluster_replica_takes_over_a_killed_master(
    redis_cluster_replicas: LocalCluster,
) -> None:
    """3 masters + 3 replicas: a key written and replicated (WAIT) survives the SIGKILL of its
    master; its replica serves the slot once every live node agrees on the promotion."""
    cluster = redis_cluster_replicas
    assert len(cluster.nodes) == 6
    assert len(set(cluster.slot_owners().values())) == 3
    key = "test-local-redis:failover"
    old_port = cluster.primary_port(key)
    with connect(old_port) as client:
        client.set(key, "kept")
        assert client.execute_command("WAIT", 1, 2000) == 1
    assert cluster.kill_primary(key) == old_port
    assert len(cluster.live_nodes) == 5
    new_port = cluster.wait_promoted(key, old_port)
    assert new_port != old_port
    assert cluster.primary_port(key) == new_port
    with connect(new_port) as client:
        assert client.role()[0] == "master"
        assert client.get(key) == "kept"
        client.set(key, "written after")


def test_sentinel_failover_keeps_replicated_writes(redis_sentinel: LocalSentinel) -> None:
    first_master = redis_sentinel.master_port()
    assert first_master == redis_sentinel.master.port
    assert redis_sentinel.url == (
        f"redis+sentinel://127.0.0.1:{redis_sentinel.sentinel.port}/mymaster/0"
    )
    sentinel = redis.sentinel.Sentinel([("127.0.0.1", redis_sentinel.sentinel.port)])
    client = sentinel.master_for("mymaster", socket_timeout=2.0, decode_responses=True)
    try:
        client.set("before", "kept")
        # The replica must hold the key before its master dies, or the failover may lose it.
        assert client.execute_command("WAIT", 1, 1000) == 1
        old_port = redis_sentinel.kill_master()
        assert old_port == first_master
        assert redis_sentinel.master.pid is None
        new_port = redis_sentinel.wait_failover(old_port)
        assert new_port == redis_sentinel.replica.port
        assert redis_sentinel.master_port() == new_port
        client.set("after", "written")
        assert client.get("before") == "kept"
        assert client.get("after") == "written"
    finally:
        client.close()
        for connection in sentinel.sentinels:
            connection.close()


def test_server_restarts_on_its_port() -> None:
    with RedisServer() as server:
        assert server.host == "127.0.0.1"
        port, pid = server.port, server.pid
        assert pid is not None
        server.restart()
        assert server.port == port
        assert server.pid not in (None, pid)
        with connect(server.port) as client:
            assert client.ping()
        server.kill()
        assert server.pid is None
        server.start()
        with connect(server.port) as client:
            assert client.ping()


def test_free_port_pair_is_bindable() -> None:
    port = free_port_pair()
    assert port + 10000 <= 65535
    with socket.socket() as first, socket.socket() as second:
        first.bind(("127.0.0.1", port))
        second.bind(("127.0.0.1", port + 10000))
