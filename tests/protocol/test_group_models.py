"""`mlx-worker group list|prune` over every job stream: the default one and each model's
(a worker is a consumer of every group it reads). Against a real redis-server and Cluster."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlx_redis_protocol.cli import main
from mlx_redis_protocol.connection import RedisClient, connect
from mlx_redis_protocol.group import list_all_consumers, prune
from mlx_redis_protocol.keys import JobStream, Keys
from mlx_redis_protocol.registry import register_model
from mlx_redis_worker.local_redis import LocalCluster
from tests.support.fleet import write_heartbeat
from tests.support.waiting import run


def group_cli(url: str, prefix: str, *args: str) -> int:
    return main(["group", *args, "--redis-url", url, "--prefix", prefix])


def keys_of(stream: JobStream) -> Keys:
    return Keys(stream.group)  # the group's name is the prefix


def json_rows(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines()]


async def consumers_on(
    redis: RedisClient, stream: JobStream, holding: list[str], idle: list[str]
) -> None:
    """A group on ``stream`` with consumers ``holding`` one pending entry each and ``idle``
    ones holding none; its model in the registry, as the worker that made the group left it."""
    await redis.xgroup_create(stream.stream, stream.group, id="0", mkstream=True)
    if stream.model is not None:
        await register_model(redis, keys_of(stream), stream.model)
    for name in holding:
        await redis.xadd(stream.stream, {"job": b"x"})
        await redis.xreadgroup(stream.group, name, {stream.stream: ">"}, count=1)
    for name in idle:
        await redis.xreadgroup(stream.group, name, {stream.stream: "0"}, count=1)


async def prepare(url: str, keys: Keys) -> None:
    """w1 (alive) and w2 (gone) read the default stream and `a`'s; w2 holds a job of `a`."""
    redis = await connect(url)
    try:
        await consumers_on(redis, keys.default_stream, [], ["w1", "w2"])
        await consumers_on(redis, keys.model_stream("a"), ["w2"], ["w1"])
        await write_heartbeat(redis, keys, "w1", b"{}", ["a"])
    finally:
        await redis.aclose()


def test_group_list_covers_every_job_stream(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    run(prepare(redis_url, keys))
    assert group_cli(redis_url, keys.prefix, "list", "--json") == 0
    rows = json_rows(capsys.readouterr().out)
    a = keys.model_stream("a").stream
    assert [(r["stream"], r["model"], r["name"], r["pending"], r["heartbeat"]) for r in rows] == [
        (keys.jobs, None, "w1", 0, True),
        (keys.jobs, None, "w2", 0, False),
        (a, "a", "w1", 0, True),
        (a, "a", "w2", 1, False),
    ]
    assert group_cli(redis_url, keys.prefix, "list") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["CONSUMER", "PENDING", "IDLE_S", "HEARTBEAT", "STREAM"]
    assert [line.split()[:2] + line.split()[3:] for line in lines[1:]] == [
        ["w1", "0", "alive", keys.jobs],
        ["w2", "0", "none", keys.jobs],
        ["w1", "0", "alive", a],
        ["w2", "1", "none", a],
    ]


def test_group_prune_judges_each_group_on_its_own(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    """w2 holds nothing in the default stream's group (removed there) but a job of `a`'s
    (kept there, for a restart or a reclaim)."""
    run(prepare(redis_url, keys))
    assert group_cli(redis_url, keys.prefix, "prune", "--idle", "0", "--dry-run") == 0
    assert capsys.readouterr().out.splitlines() == [f"would remove w2 from {keys.jobs}"]
    assert group_cli(redis_url, keys.prefix, "prune", "--idle", "0", "--json") == 0
    (row,) = json_rows(capsys.readouterr().out)
    assert (row["name"], row["stream"], row["action"]) == ("w2", keys.jobs, "removed")
    assert group_cli(redis_url, keys.prefix, "list", "--json") == 0
    left = [(r["stream"], r["name"]) for r in json_rows(capsys.readouterr().out)]
    a = keys.model_stream("a").stream
    assert left == [(keys.jobs, "w1"), (a, "w1"), (a, "w2")]


def test_group_list_with_model_streams_only(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    """No default stream's group yet (say, it was lost): the model streams' groups are
    listed all the same; without any group at all, it is the usual usage error."""

    async def model_only() -> None:
        redis = await connect(redis_url)
        try:
            await consumers_on(redis, keys.model_stream("b"), [], ["w9"])
        finally:
            await redis.aclose()

    assert group_cli(redis_url, keys.prefix, "list") == 2
    assert "no consumer group" in capsys.readouterr().err
    run(model_only())
    assert group_cli(redis_url, keys.prefix, "list", "--json") == 0
    (row,) = json_rows(capsys.readouterr().out)
    assert (row["name"], row["model"]) == ("w9", "b")


@pytest.mark.timeout(120)
def test_list_and_prune_model_streams_on_a_cluster(
    redis_cluster: LocalCluster, prefix: str
) -> None:
    keys = Keys(prefix)
    models = ["m1", "m2", "m3", "m4", "m5"]

    async def main() -> None:
        redis = await connect(redis_cluster.url)
        try:
            await consumers_on(redis, keys.default_stream, [], ["gone"])
            for model in models:
                await consumers_on(redis, keys.model_stream(model), ["holder"], ["gone"])
            listed = await list_all_consumers(redis, keys)
            assert len(listed) == 1 + 2 * len(models)
            pruned = await prune(redis, keys, 0)
            assert [(p.consumer.as_dict()["stream"], p.removed) for p in pruned] == [
                (keys.jobs, True),
                *((keys.model_stream(m).stream, True) for m in models),
            ]
            left = await list_all_consumers(redis, keys)
            assert [(c.as_dict()["model"], c.name) for c in left] == [(m, "holder") for m in models]
        finally:
            await redis.aclose()

    run(main())
