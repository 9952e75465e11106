"""Clients across a Redis Cluster failover (3 masters + 3 replicas, a master SIGKILLed): the
async Client's follower and its submits, and the blocking SyncClient, follow the promoted
replica by themselves, with no worker involved (the events are written as a worker would)."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import pytest
import redis
from redis.crc import key_slot

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.codec_job import decode_job
from mlx_redis_protocol.connection import connect, is_unavailable
from mlx_redis_protocol.constants import JOB_FIELD
from mlx_redis_protocol.errors import RedisUnavailable
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import Event
from mlx_redis_protocol.replay_log import Outcome, publish_events, read_log
from mlx_redis_protocol.sync_client import SyncClient
from mlx_redis_worker.local_redis import LocalCluster
from tests.protocol.helpers import begin, delta, emit, run_of, text_events
from tests.support.waiting import run


@pytest.mark.timeout(120)
def test_a_follower_and_submits_follow_the_promoted_replica(
    redis_cluster_replicas: LocalCluster, keys: Keys
) -> None:
    """The master holding the job stream and a followed request's log dies mid-stream. The
    follower (its log re-read only every 30 s, so only the moved subscription can deliver in
    time) yields every event to done without raising; a submit through the same Client and
    one through a SyncClient, both made before the kill, go to the promoted master."""
    cluster = redis_cluster_replicas
    owner = cluster.primary_port(keys.jobs)
    # A request whose log lives with the job stream, on the master about to die.
    rid = next(
        r for r in (f"fo-{i}" for i in range(1000)) if cluster.primary_port(keys.log(r)) == owner
    )
    pieces = ["one ", "two ", "three"]
    events = text_events(rid, pieces)

    async def scenario() -> tuple[list[Event], list[str], float]:
        worker = await connect(cluster.url)
        client = Client(
            cluster.url, prefix=keys.prefix, recheck_interval=30, unavailable_timeout=30
        )
        sync = await asyncio.to_thread(SyncClient, cluster.url, prefix=keys.prefix)
        try:
            await client.connect()
            await client.submit("first", request_id=rid)
            await asyncio.to_thread(sync.served_models)  # its slot map is read before the kill
            seen: list[Event] = []
            first = asyncio.Event()

            async def follow() -> None:
                async with aclosing(client.stream(rid, timeout=20)) as stream:
                    async for event in stream:
                        seen.append(event)
                        if event.seq == 1:
                            first.set()

            following = asyncio.create_task(follow())
            await emit(worker, keys, events[0])
            await asyncio.wait_for(first.wait(), 10)
            await asyncio.to_thread(cluster.wait_replicated, keys.jobs)
            old = await asyncio.to_thread(cluster.kill_primary, keys.jobs)
            await asyncio.to_thread(cluster.wait_promoted, keys.jobs, old)
            await worker.aclose()
            worker = await connect(cluster.url)  # a worker that found the new master
            promoted_at = time.monotonic()
            await emit(worker, keys, *events[1:])
            await asyncio.wait_for(following, 20)
            followed_in = time.monotonic() - promoted_at
            after = [
                await client.submit("after the failover"),
                await asyncio.to_thread(sync.submit, "after the failover, blocking"),
            ]
            entries = await worker.xrange(keys.jobs, "-", "+")
            queued = [decode_job(fields[JOB_FIELD.encode()]).request_id for _, fields in entries]
            return seen, [r for r in after if r in queued], followed_in
        finally:
            await asyncio.to_thread(sync.close)
            await client.aclose()
            await worker.aclose()

    seen, queued_after, followed_in = run(scenario())
    assert [event.seq for event in seen] == [0, 1, 2, 3, 4]
    assert seen[-1] == events[-1]
    assert followed_in < 15, followed_in
    assert len(queued_after) == 2, "both submits after the promotion must be in the job stream"


@pytest.mark.timeout(120)
def test_a_cluster_that_stays_down_ends_commands_and_streams_with_redis_unavailable(
    redis_cluster_replicas: LocalCluster, keys: Keys
) -> None:
    """The job stream's master dies, then the replica that took over: its slots stay
    uncovered. A submit and a stream try again for the client's ``unavailable_timeout`` and
    end with RedisUnavailable (the typed error), not a hang or a raw redis-py error."""
    cluster = redis_cluster_replicas

    async def scenario() -> tuple[str, str, float]:
        client = Client(cluster.url, prefix=keys.prefix, unavailable_timeout=2)
        try:
            rid = await client.submit("before")
            old = await asyncio.to_thread(cluster.kill_primary, keys.jobs)
            await asyncio.to_thread(cluster.wait_promoted, keys.jobs, old)
            await asyncio.to_thread(cluster.kill_primary, keys.jobs)
            started = time.monotonic()
            with pytest.raises(RedisUnavailable) as submitting:
                await client.submit("after")
            with pytest.raises(RedisUnavailable) as following:
                async with aclosing(client.stream(rid)) as stream:
                    [event async for event in stream]
            return str(submitting.value), str(following.value), time.monotonic() - started
        finally:
            await client.aclose()

    submitting, following, seconds = run(scenario())
    assert "may or may not have been queued" in submitting or "was not queued" in submitting
    assert "Redis unreachable" in following
    assert seconds < 20


def move_slot(cluster: LocalCluster, key: str) -> None:
    """Reshard ``key``'s slot, with its keys, to another master (as ``redis-cli --cluster
    reshard`` does for each slot), telling every master of its new owner."""
    slot = key_slot(key.encode())
    source_port = cluster.primary_port(key)
    masters = [node for node in cluster.nodes if node.process is not None]
    source = next(node for node in masters if node.port == source_port)
    target = next(node for node in masters if node.port != source_port)
    clients = {node.port: redis.Redis(port=node.port) for node in masters}
    try:
        ids = {port: client.execute_command("CLUSTER", "MYID") for port, client in clients.items()}
        clients[target.port].execute_command(
            "CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source.port]
        )
        clients[source.port].execute_command(
            "CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target.port]
        )
        moving = clients[source.port].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        if moving:
            clients[source.port].execute_command(
                "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *moving
            )
        for client in clients.values():
            client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target.port])
    finally:
        for client in clients.values():
            client.close()


@pytest.mark.timeout(120)
def test_a_step_published_after_its_slot_moved_follows_it() -> None:
    """A worker's events go as one script call per node, reaching keys its slot map says the
    node serves. After a resharding moved a request's slot, the call that still goes to the
    old node fails unavailable (the map read again); the next one lands on the new node, and
    the log holds every event once, in order."""
    keys = Keys("moved")
    requests = [f"mv-{i}" for i in range(6)]
    with LocalCluster() as cluster:

        async def scenario() -> tuple[bool, list[Outcome], list[list[int]]]:
            client = await connect(cluster.url)
            try:
                for rid in requests:
                    await begin(client, keys, rid, 1)
                await publish_events(
                    client, keys, [delta(rid, 1, "a") for rid in requests], runs=runs(requests)
                )
                move_slot(cluster, keys.log(requests[0]))
                step = [delta(rid, 2, "b") for rid in requests]
                try:
                    await publish_events(client, keys, step, runs=runs(requests))
                    stale_failed = False
                except Exception as exc:
                    stale_failed = is_unavailable(exc)
                outcomes = await publish_events(client, keys, step, runs=runs(requests))
                logs = [[e.seq for e in await read_log(client, keys, rid)] for rid in requests]
                return stale_failed, outcomes, logs
            finally:
                await client.aclose()

        stale_failed, outcomes, logs = run(scenario())
    assert stale_failed
    assert outcomes == [Outcome.LOGGED] * len(requests)
    assert logs == [[1, 2]] * len(requests)


def runs(requests: list[str]) -> dict[str, str]:
    return {rid: run_of(1) for rid in requests}
