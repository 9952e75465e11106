"""Lua scripts go by their SHA1 (EVALSHA), never by their text, and still run where a server's
script cache is empty: a restarted server, a failed-over master, a Cluster node that never ran
them (SCRIPT FLUSH stands in for each)."""

from __future__ import annotations

from typing import Any

import redis

from mlx_redis_protocol.connection import connect
from mlx_redis_protocol.group import remove_idle_consumer
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.lua import run_script, run_script_each
from mlx_redis_protocol.replay_log import Outcome, begin_attempt, publish_events, read_log
from mlx_redis_worker.local_redis import LocalCluster, RedisServer
from tests.protocol.helpers import begin, delta, done, emit, run_of
from tests.support.waiting import run

# Enough requests for their hash slots to land on every node of a 3-master Cluster.
REQUESTS = [f"req-{i}" for i in range(12)]
ECHO_KEYS = "return {KEYS[1], ARGV[1]}"


def script_calls(url: str) -> dict[str, int]:
    """How often the server ran each script command (INFO commandstats), by command."""
    client = redis.Redis.from_url(url)
    try:
        stats: dict[str, Any] = client.info("commandstats")
    finally:
        client.close()
    names = ("eval", "evalsha", "script|load")
    return {name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in names}


def test_a_single_server_runs_scripts_by_sha_after_losing_them(keys: Keys) -> None:
    """Every script of the protocol, and several calls pipelined, after SCRIPT FLUSH; each
    script is loaded once, and no call carries the script's text (no EVAL)."""

    async def scenario() -> tuple[list[Outcome], int, bool, list[Any], list[int]]:
        client = await connect(server.url)
        try:
            await emit(client, keys, delta("r1", 1, "a"))
            await client.xgroup_create(keys.jobs, keys.group, id="0", mkstream=True)
            await client.script_flush()
            outcomes = await publish_events(
                client, keys, [delta("r1", 2, "b"), done("r1", 3, "ab")], runs={"r1": run_of(1)}
            )
            continued = await begin_attempt(client, keys, "r2", 1, 600, run_of(1))
            removed = await remove_idle_consumer(client, keys.default_stream, "nobody")
            await client.script_flush()
            echoed = await run_script_each(
                client, ECHO_KEYS, [([keys.log("e1")], [b"1"]), ([keys.log("e2")], [b"2"])]
            )
            echoed.append(await run_script(client, ECHO_KEYS, [keys.log("e3")], [b"3"]))
            return (
                outcomes,
                continued,
                removed,
                echoed,
                [e.seq for e in await read_log(client, keys, "r1")],
            )
        finally:
            await client.aclose()

    with RedisServer() as server:
        outcomes, continued, removed, echoed, seqs = run(scenario())
        calls = script_calls(server.url)
    assert outcomes == [Outcome.LOGGED, Outcome.LOGGED]
    assert seqs == [1, 2, 3]
    assert continued == 0 and removed
    assert echoed == [
        [keys.log(name).encode(), value]
        for name, value in (("e1", b"1"), ("e2", b"2"), ("e3", b"3"))
    ]
    assert calls["eval"] == 0
    # Before the first flush: BEGIN_ATTEMPT and PUBLISH_EVENTS; after it, those two and
    # REMOVE_IDLE_CONSUMER; after the second, the echo script once (the pipeline's load
    # serves the single call after it).
    assert calls["script|load"] == 2 + 3 + 1


def test_a_cluster_runs_scripts_by_sha_after_losing_them(
    redis_cluster: LocalCluster, keys: Keys
) -> None:
    """On a Cluster the publish script goes as one EVALSHA per node in one pipeline, carrying
    every request of that node whatever its slot (twelve requests, three calls): after
    SCRIPT FLUSH on one node, only the calls that node answered NOSCRIPT are sent again, after
    the script is loaded there (and nowhere else); after SCRIPT FLUSH on every node, every call
    still goes through. Nothing is logged twice."""
    flushed_url = redis_cluster.urls[0]
    evals_before = sum(script_calls(url)["eval"] for url in redis_cluster.urls)

    async def scenario() -> tuple[list[Outcome], list[Outcome], int, list[list[int]], int]:
        client = await connect(redis_cluster.url)
        try:
            for rid in REQUESTS:
                await begin(client, keys, rid, 1)
            first = [delta(rid, 1, "a") for rid in REQUESTS]
            await publish_events(client, keys, first, runs=runs())
            # Again (it logs nothing twice), counted now that every node has the script.
            calls_before = sum(script_calls(url)["evalsha"] for url in redis_cluster.urls)
            await publish_events(client, keys, first, runs=runs())
            one_step = sum(script_calls(url)["evalsha"] for url in redis_cluster.urls)
            one_step -= calls_before
            one = redis.Redis.from_url(flushed_url)
            try:
                one.script_flush()
            finally:
                one.close()
            loads_before = {url: script_calls(url)["script|load"] for url in redis_cluster.urls}
            one_node_lost = await publish_events(
                client, keys, [delta(rid, 2, "b") for rid in REQUESTS], runs=runs()
            )
            loads_after = {url: script_calls(url)["script|load"] for url in redis_cluster.urls}
            assert {url: loads_after[url] - loads_before[url] for url in loads_after} == {
                url: int(url == flushed_url) for url in redis_cluster.urls
            }
            await client.script_flush()
            all_lost = await publish_events(
                client, keys, [done(rid, 3, "ab") for rid in REQUESTS], runs=runs()
            )
            await client.script_flush()
            next_attempt = await begin_attempt(client, keys, "fresh", 1, 600, run_of(1))
            logs = [[e.seq for e in await read_log(client, keys, rid)] for rid in REQUESTS]
            return one_node_lost, all_lost, next_attempt, logs, one_step
        finally:
            await client.aclose()

    one_node_lost, all_lost, next_attempt, logs, one_step = run(scenario())
    assert len({redis_cluster.primary_port(keys.log(rid)) for rid in REQUESTS}) == 3
    assert one_step == 3
    assert one_node_lost == [Outcome.LOGGED] * len(REQUESTS)
    assert all_lost == [Outcome.LOGGED] * len(REQUESTS)
    assert next_attempt == 0
    assert logs == [[1, 2, 3]] * len(REQUESTS)
    assert sum(script_calls(url)["eval"] for url in redis_cluster.urls) == evals_before


def runs() -> dict[str, str]:
    return {rid: run_of(1) for rid in REQUESTS}
