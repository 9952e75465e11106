"""The worker checks every Redis permission it needs at start and names the first one missing.

Real ACL users on the session's redis-server (``ACL SETUSER`` as its default user), and the
real ``mlx-worker run`` process. A command only the worker's Lua scripts call (PUBLISH on a
single server) is named like any other: Redis checks the ACL inside scripts too.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
from pathlib import Path

import pytest
import redis

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.connection import connect
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import DoneEvent
from mlx_redis_protocol.permissions import redis_user
from mlx_redis_worker.daemon.permissions import check_permissions, probes
from mlx_redis_worker.local_redis import LocalCluster
from tests.daemon.helpers import check_stream, collect
from tests.support.acl import (
    PASSWORD,
    PROTOCOL_DOCS,
    MakeUser,
    _rules,
    denials,
    documented_client_acl,
    documented_minimum_acl,
    refusal_line,
    start_refused,
)
from tests.support.environment import clean_environment
from tests.support.processes import MODEL, WORKER_COMMAND, WorkerFactory
from tests.support.waiting import run


@pytest.mark.parametrize(
    ("rule", "command", "needed_to"),
    [
        ("-xautoclaim", "XAUTOCLAIM", "reclaim jobs of workers that died"),
        # Called only inside the publish script on a single server.
        ("-publish", "PUBLISH", "stream events to subscribers"),
        # Called by the ack pipeline and inside the dead-letter script.
        ("-xdel", "XDEL", "delete finished jobs"),
        ("-xgroup|delconsumer", "XGROUP DELCONSUMER", "leave the consumer group when stopping"),
        ("-pexpire", "PEXPIRE", "keep the heartbeat alive while Redis is full"),
        ("-subscribe", "SUBSCRIBE", "receive control commands"),
        # Scripts go by SHA1, and are loaded where a server lacks them.
        ("-evalsha", "EVALSHA", "run the worker's Lua scripts"),
        (
            "-script|load",
            "SCRIPT LOAD",
            "load the worker's Lua scripts into a server that lacks them",
        ),
    ],
)
def test_a_missing_command_is_named_before_the_model_loads(
    acl_user: MakeUser,
    admin: redis.Redis,
    prefix: str,
    tmp_path: Path,
    rule: str,
    command: str,
    needed_to: str,
) -> None:
    user, url = acl_user(["on", f">{PASSWORD}", f"~{prefix}:*", f"&{prefix}:*", "+@all", rule])
    line = refusal_line(start_refused(url, prefix, tmp_path))
    assert line == (
        f"mlx-worker: Redis user {user!r} may not run {command} (needed to {needed_to}); "
        "grant it (see docs/redis.md: minimum ACL)"
    )
    # Exactly one refusal: the probe of the missing command, nothing sent after it.
    assert len(denials(admin, user)) == 1


def test_keys_outside_the_grant_are_named(acl_user: MakeUser, prefix: str, tmp_path: Path) -> None:
    user, url = acl_user(["on", f">{PASSWORD}", "~elsewhere:*", f"&{prefix}:*", "+@all"])
    line = refusal_line(start_refused(url, prefix, tmp_path))
    assert line == (
        f"mlx-worker: Redis user {user!r} has no permission for the key '{prefix}:jobs' "
        f"(XGROUP CREATE, needed to create the consumer group); grant ~{prefix}:* "
        "(see docs/redis.md: minimum ACL)"
    )


def test_channels_outside_the_grant_are_named(
    acl_user: MakeUser, prefix: str, tmp_path: Path
) -> None:
    user, url = acl_user(["on", f">{PASSWORD}", f"~{prefix}:*", "&elsewhere:*", "+@all"])
    line = refusal_line(start_refused(url, prefix, tmp_path))
    pattern = (
        rf"mlx-worker: Redis user '{user}' has no permission for the channel "
        rf"'{prefix}:out:\{{permission-probe-[0-9a-f]+\}}' "
        rf"\(pattern {prefix}:out:\{{request_id\}}; PUBLISH, needed to stream events "
        rf"to subscribers\); grant &{prefix}:\* \(see docs/redis.md: minimum ACL\)"
    )
    assert re.fullmatch(pattern, line), line


@pytest.mark.timeout(180)
def test_the_documented_minimum_acl_serves_a_job_end_to_end(
    acl_user: MakeUser,
    admin: redis.Redis,
    workers: WorkerFactory,
    prefix: str,
) -> None:
    """A user with exactly the minimum ACL line of docs/redis.md: the worker starts, serves a job to
    a client of the same user, `group list` works, a clean stop removes the consumer (of both
    streams it reads: the default one and its model's), and Redis denied nothing along the
    way."""
    user, url = acl_user(documented_minimum_acl(prefix))
    worker = workers.start("acl-minimum", redis_url=url)

    async def main() -> None:
        async with Client(url, prefix=prefix) as client:
            request_id = await client.submit("hello there", max_tokens=8, temperature=0.0)
            summary = check_stream(await collect(client, request_id), request_id)
            assert isinstance(summary.terminal, DoneEvent), summary.terminal

    run(main())
    listed = subprocess.run(
        [*WORKER_COMMAND, "group", "list", "--json", "--redis-url", url, "--prefix", prefix],
        capture_output=True,
        text=True,
        env=clean_environment({}),
        timeout=60,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    keys = Keys(prefix)
    streams = (keys.default_stream, keys.model_stream(MODEL))
    assert sorted((r["name"], r["stream"], r["pending"], r["heartbeat"]) for r in rows) == [
        ("acl-minimum", stream.stream, 0, True) for stream in streams
    ]
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0, worker.log_tail()
    for stream in streams:
        assert admin.xinfo_consumers(stream.stream, stream.group) == [], stream
    assert denials(admin, user) == [], denials(admin, user)


@pytest.mark.parametrize("fair_models", [(), (MODEL,)], ids=["fifo", "fair-share"])
def test_probes_change_nothing(redis_url: str, prefix: str, fair_models: tuple[str, ...]) -> None:
    """The probes (with fair share's, for a model served with it) leave no key behind, create
    no consumer but the worker's own, count no delivery of the worker's pending jobs and add
    no dead letter."""
    keys = Keys(prefix)

    async def main() -> None:
        client = await connect(redis_url)
        try:
            await client.xgroup_create(keys.jobs, keys.group, id="0", mkstream=True)
            await client.xadd(keys.jobs, {"job": b"x"})
            await client.xreadgroup(keys.group, "mine", {keys.jobs: ">"}, count=1)
            before = sorted(await client.keys(f"{prefix}:*"))
            await check_permissions(client, keys, "mine", "default", 10, fair_models)
            assert sorted(await client.keys(f"{prefix}:*")) == before
            pending = await client.xpending_range(keys.jobs, keys.group, "-", "+", 10)
            assert [(p["consumer"], p["times_delivered"]) for p in pending] == [(b"mine", 1)]
            consumers = await client.xinfo_consumers(keys.jobs, keys.group)
            assert [c["name"] for c in consumers] == [b"mine"]
            assert await client.xlen(keys.jobs) == 1
        finally:
            await client.aclose()

    run(main())


@pytest.mark.timeout(120)
def test_probes_route_on_a_cluster(redis_cluster: LocalCluster, prefix: str) -> None:
    """On a Cluster the probes use the sharded pub/sub commands and each reaches the node of
    its key: none is refused for any reason but the one planned (XADD's id 0-0), which a
    refusal such as CROSSSLOT or MOVED would break."""
    keys = Keys(prefix)

    async def main() -> None:
        client = await connect(redis_cluster.url)
        try:
            names = [probe.command for probe in probes(client, keys, "mine", 10)]
            assert "SPUBLISH" in names and "SSUBSCRIBE" in names
            assert "PUBLISH" not in names and "SUBSCRIBE" not in names
            for probe in probes(client, keys, "mine", 10):
                try:
                    await probe.send()
                except redis.exceptions.ResponseError as exc:
                    # Only the documented argument refusal: XADD with id 0-0.
                    assert probe.command == "XADD" and "0-0" in str(exc), (probe, exc)
                    assert probe.subject == keys.dead
            await check_permissions(client, keys, "mine", "default", 10)
        finally:
            await client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("url", "user"),
    [
        ("redis://localhost:6379/0", "default"),
        ("redis://:pw@localhost:6379/0", "default"),
        ("rediss://bob:pw@localhost:6380/0", "bob"),
        ("redis://b%40b:pw@localhost/0", "b@b"),
        ("redis+sentinel://carol:pw@s1:26379,s2:26379/mymaster", "carol"),
        ("unix:///run/redis.sock", "default"),
    ],
)
def test_the_user_a_url_logs_in_as(url: str, user: str) -> None:
    assert redis_user(url) == user


@pytest.mark.timeout(180)
def test_the_documented_client_acl_submits_follows_and_aborts(
    acl_user: MakeUser, admin: redis.Redis, workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    """A client with exactly protocol/README.md's client line (docs/redis.md shows the same)
    checks the catalogue, queues a job, follows it to its end, aborts another and pings the
    workers; Redis denies it nothing."""
    rules = documented_client_acl(prefix)
    assert " ".join(_rules(lambda line: line.startswith("user client on"))) == " ".join(
        _rules(lambda line: line.startswith("user client on"), PROTOCOL_DOCS)
    )
    user, url = acl_user(rules)
    workers.start("acl-client-worker", redis_url=redis_url, max_concurrency=1)

    async def main() -> None:
        async with Client(url, prefix=prefix) as client:
            request_id = await client.submit("hello there", max_tokens=8, temperature=0.0)
            summary = check_stream(await collect(client, request_id), request_id)
            assert isinstance(summary.terminal, DoneEvent), summary.terminal
            long = await client.submit("a long story", max_tokens=2000, temperature=0.0)
            (reply,) = await client.abort(long)
            assert reply.ok, reply
            ended = await client.wait(long, timeout=60)
            assert isinstance(ended, DoneEvent) and ended.finish_reason == "abort", ended
            assert [r.ok for r in await client.ping()] == [True]
            unchecked = Client(url, prefix=prefix, require_worker=False)
            async with unchecked:
                await unchecked.submit("for later", model="not-served-yet", max_tokens=1)

    run(main())
    assert denials(admin, user) == [], denials(admin, user)
