"""One URL for every Redis deployment: parsing, detection, refusals, and what is transient."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis
from fakeredis import TcpFakeServer
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    AuthenticationError,
    ClusterDownError,
    NoPermissionError,
    OutOfMemoryError,
    SlotNotCoveredError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from mlx_redis_protocol.connection import (
    SentinelAddress,
    UnsupportedRedis,
    connect,
    is_unavailable,
    parse_sentinel_url,
    redact,
    stream_read_keys,
)
from mlx_redis_protocol.errors import RedisUnavailable, RequestNotFound, StreamTimeout
from mlx_redis_protocol.keys import Keys
from mlx_redis_worker.daemon.fair_queue import FairQueue
from mlx_redis_worker.daemon.job_queue import JobQueue
from mlx_redis_worker.local_redis import LocalCluster, free_port
from tests.support.waiting import run


def test_sentinel_urls_name_every_sentinel_the_service_and_the_database() -> None:
    address = parse_sentinel_url(
        "redis+sentinel://app:p%40ss@10.0.0.1:26380,10.0.0.2,[::1]:5000/cache/3"
        "?sentinel_password=s3cret"
    )
    assert address == SentinelAddress(
        sentinels=(("10.0.0.1", 26380), ("10.0.0.2", 26379), ("::1", 5000)),
        service="cache",
        db=3,
        username="app",
        password="p@ss",
        sentinel_options={"password": "s3cret"},
    )
    assert parse_sentinel_url("redis+sentinel://h:1/svc").db == 0


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://h:1",  # no service
        "redis+sentinel://h:1/svc/0/extra",
        "redis+sentinel://h:1/svc/zero",
        "redis+sentinel://h:port/svc",
        "redis+sentinel:///svc",  # no sentinel
        "redis+sentinel://h:1/svc?ssl=1",  # an option nobody reads would be silently ignored
        "redis://h:1/0",
    ],
)
def test_malformed_sentinel_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError):
        parse_sentinel_url(url)


def test_passwords_never_reach_messages() -> None:
    assert redact("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact("rediss://user:pw@h:6380/0?ssl_ca_certs=/ca") == (
        "rediss://user:***@h:6380/0?ssl_ca_certs=/ca"
    )
    assert redact("redis+sentinel://u:pw@a:1,b:2/svc?sentinel_password=x") == (
        "redis+sentinel://u:***@a:1,b:2/svc?sentinel_password=***"
    )
    assert redact("redis://h:6379/0") == "redis://h:6379/0"


def test_only_redis_being_unreachable_is_worth_waiting_for() -> None:
    for transient in (
        RedisConnectionError("refused"),
        RedisTimeoutError("slow"),
        ConnectionResetError(),
        ClusterDownError("CLUSTERDOWN"),
        SlotNotCoveredError("moving"),
        OSError("socket"),
    ):
        assert is_unavailable(transient), transient
    for final in (
        AuthenticationError("bad password"),  # a ConnectionError in redis-py
        NoPermissionError("acl"),
        OutOfMemoryError("oom"),
        RedisUnavailable("already reported"),  # a ClientError: reported, not retried
        StreamTimeout("nothing came"),  # a TimeoutError, hence an OSError
        RequestNotFound("r1"),
        ValueError("bug"),
    ):
        assert not is_unavailable(final), final


def test_a_single_server_is_detected_and_its_client_sends_nothing_twice(redis_url: str) -> None:
    async def scenario() -> tuple[type, int]:
        redis = await connect(redis_url)
        try:
            return type(redis), redis.get_retry().get_retries()  # type: ignore[union-attr]
        finally:
            await redis.aclose()

    kind, retries = run(scenario())
    assert kind is Redis
    assert retries == 0


@pytest.fixture
def fake_server() -> Iterator[str]:
    port = free_port()
    server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_answering_hello_in_resp2_form_is_a_single_server(fake_server: str) -> None:
    """fakeredis (the demo's embedded Redis) answers HELLO as a flat list, and resets the
    connection to RESP2 when asked a bare HELLO: replies read afterwards (stream replies
    differ between the two) must still parse."""

    async def scenario() -> tuple[bool, object]:
        redis = await connect(fake_server)
        try:
            await redis.xgroup_create("jobs", "group", id="0", mkstream=True)
            await redis.xadd("jobs", {"job": b"x"})
            read = await redis.xreadgroup("group", "me", {"jobs": ">"}, count=1)
            return isinstance(redis, Redis), read
        finally:
            await redis.aclose()

    single, read = run(scenario())
    assert single
    assert [[stream, [fields for _, fields in entries]] for stream, entries in read] == [
        [b"jobs", [{b"job": b"x"}]]
    ]


def test_a_cluster_node_url_gives_a_cluster_client(redis_cluster: object) -> None:
    url = redis_cluster.url  # type: ignore[attr-defined]

    async def scenario() -> tuple[bool, bool, int]:
        detected = await connect(url)
        told = await connect(url, topology="cluster")
        try:
            # Keys on every node: the client follows the slots.
            for index in range(30):
                await detected.set(f"spread:{{{index}}}", index)
            nodes = {detected.get_node_from_key(f"spread:{{{i}}}").name for i in range(30)}  # type: ignore[union-attr]
            return isinstance(detected, RedisCluster), isinstance(told, RedisCluster), len(nodes)
        finally:
            await detected.aclose()
            await told.aclose()

    detected, told, nodes = run(scenario())
    assert detected and told
    assert nodes == len(redis_cluster.nodes)  # type: ignore[attr-defined]


def test_urls_naming_the_wrong_kind_of_server_are_one_clear_line(
    redis_url: str, redis_cluster: object, redis_sentinel: object
) -> None:
    sentinel_port = redis_sentinel.sentinel.port  # type: ignore[attr-defined]
    cluster_url = redis_cluster.url  # type: ignore[attr-defined]

    async def refused(url: str, **options: str) -> str:
        with pytest.raises(UnsupportedRedis) as caught:
            await connect(url, **options)
        return str(caught.value)

    async def scenario() -> list[str]:
        return [
            await refused(f"redis://127.0.0.1:{sentinel_port}/0"),
            await refused(redis_url, topology="cluster"),
            await refused(cluster_url.replace("/0", "/3")),
        ]

    sentinel_as_server, server_as_cluster, database_on_cluster = run(scenario())
    assert "is a Redis Sentinel: name it as redis+sentinel://" in sentinel_as_server
    assert "is not a Redis Cluster node (its mode is standalone)" in server_as_cluster
    assert "refused the connection set-up: SELECT is not allowed in cluster mode" in (
        database_on_cluster
    )


def getkeys_calls(cluster: LocalCluster) -> int:
    """``COMMAND GETKEYS`` calls so far, summed over the Cluster's nodes."""
    total = 0
    for url in cluster.urls:
        node = redis.Redis.from_url(url)
        try:
            stats = node.info("commandstats").get("cmdstat_command|getkeys", {})
            total += int(stats.get("calls", 0))
        finally:
            node.close()
    return total


def test_a_workers_stream_reads_on_a_cluster_ask_no_node_for_their_keys(
    redis_cluster: LocalCluster, prefix: str
) -> None:
    """The worker's read path (XREADGROUP new and own pending, the fair queue's XREAD wait)
    goes to the stream's node with no ``COMMAND GETKEYS`` round trip before it (redis-py asks
    one before every XREAD and XREADGROUP)."""
    keys = Keys(prefix)
    stream = keys.model_stream("m")

    async def scenario() -> tuple[list[str], list[str], int]:
        client = await connect(redis_cluster.url)
        try:
            queue = JobQueue(redis=client, stream=stream, consumer="w1", lease_ms=60_000)
            await queue.ensure_group()
            await client.xadd(stream.stream, {"job": b"x"})
            fair = FairQueue(
                redis=client,
                stream=stream,
                keys=keys.fair("m"),
                consumer="w1",
                tenant_weights_key=keys.tenant_weights,
                age_bound_seconds=30,
            )
            before = getkeys_calls(redis_cluster)
            new = [d.entry_id for d in await queue.read_new(count=4, block_ms=10)]
            own = [d.entry_id for d in await queue.read_own_pending(count=4)]
            await fair.wait_for_new("0-0", block_ms=10)  # returns at once: an entry is there
            return new, own, getkeys_calls(redis_cluster) - before
        finally:
            await client.aclose()

    new, own, asked = run(scenario())
    assert len(new) == 1 and own == new
    assert asked == 0


@pytest.mark.parametrize(
    ("command", "keys"),
    [
        (("XREAD", "COUNT", 1, "STREAMS", "a", "b", "0", "0"), ("a", "b")),
        (("xreadgroup", "GROUP", "g", "c", "BLOCK", 5, "streams", b"s", ">"), (b"s",)),
        # A group or consumer named STREAMS is not the keyword: the search starts after them.
        (("XREADGROUP", "GROUP", "STREAMS", "STREAMS", "STREAMS", "s", ">"), ("s",)),
        (("XREAD", "STREAMS", "a", "b", "0"), None),  # odd: the server refuses it
        (("XREAD", "COUNT", 1), None),
        (("GET", "STREAMS"), None),
    ],
)
def test_stream_read_keys_are_found_as_the_server_finds_them(
    command: tuple[object, ...], keys: tuple[object, ...] | None
) -> None:
    assert stream_read_keys(command) == keys
