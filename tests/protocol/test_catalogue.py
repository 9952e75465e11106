"""The fleet's catalogue (protocol/mlx_redis_protocol/catalogue.py) and `mlx-worker models`,
against a real redis-server and a real Cluster, with hand-written heartbeats and streams: no worker
runs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

import pytest
from redis.crc import key_slot

from mlx_redis_protocol.catalogue import (
    fleet_models,
    job_streams,
    live_heartbeats,
    model_streams,
    served_models,
)
from mlx_redis_protocol.cli import main
from mlx_redis_protocol.connection import RedisClient, connect
from mlx_redis_protocol.heartbeat import Heartbeat, ServedModel
from mlx_redis_protocol.keys import JobStream, Keys
from mlx_redis_protocol.registry import register_model
from mlx_redis_worker.local_redis import LocalCluster, free_port
from tests.support.fleet import write_heartbeat
from tests.support.waiting import run


def beat(
    worker_id: str,
    models: Mapping[str, tuple[int, int]],
    default: str | None = None,
    media: Mapping[str, tuple[str, ...]] | None = None,
) -> Heartbeat:
    """A current worker's heartbeat; ``models`` maps a name to (free slots, max), ``media``
    a name to what it takes besides text."""
    return Heartbeat(
        worker_id=worker_id,
        pid=1,
        started_at=1.0,
        in_flight=0,
        default_model=default if default is not None else next(iter(models), None),
        models={
            name: ServedModel(
                max_concurrency=cap,
                free_slots=free,
                in_flight=cap - free,
                media=(media or {}).get(name, ()),
            )
            for name, (free, cap) in models.items()
        },
        version="test",
    )


async def write_beat(redis: RedisClient, keys: Keys, heartbeat: Heartbeat) -> None:
    await write_heartbeat(
        redis, keys, heartbeat.worker_id, heartbeat.encode(), list(heartbeat.models)
    )


async def write_old_beat(redis: RedisClient, keys: Keys, worker_id: str) -> None:
    """An older worker's heartbeat: one `model`, no `models`."""
    value = {"worker_id": worker_id, "pid": 2, "started_at": 1.0, "in_flight": 0, "model": "/m"}
    await write_heartbeat(redis, keys, worker_id, json.dumps(value))


async def queue_jobs(
    redis: RedisClient, stream: JobStream, total: int, delivered: int = 0, dead: int = 0
) -> None:
    """``total`` entries in the stream's group, ``delivered`` of them read (pending)."""
    await redis.xgroup_create(stream.stream, stream.group, id="0", mkstream=True)
    for i in range(total):
        await redis.xadd(stream.stream, {"job": f"j{i}".encode()})
    if delivered:
        await redis.xreadgroup(stream.group, "c1", {stream.stream: ">"}, count=delivered)
    for i in range(dead):
        await redis.xadd(stream.dead, {"job": f"d{i}".encode(), "code": b"malformed"})


async def prepare_fleet(redis: RedisClient, keys: Keys) -> None:
    """Two workers serving `a` (one of them `b` too); an older worker; a value that is not
    a heartbeat; `c` has a stream and no worker; `a` has waiting and pending jobs."""
    await write_beat(redis, keys, beat("w1", {"a": (3, 4), "b": (2, 2)}))
    await write_beat(redis, keys, beat("w2", {"a": (1, 8)}))
    await write_old_beat(redis, keys, "old")
    await write_heartbeat(redis, keys, "junk", b"1")
    await queue_jobs(redis, keys.model_stream("a"), total=5, delivered=2, dead=1)
    await queue_jobs(redis, keys.model_stream("c"), total=1)
    await register_model(redis, keys, "c")  # as a producer queueing unchecked does
    await queue_jobs(redis, keys.default_stream, total=2, dead=3)


def test_live_heartbeats_and_served_models(redis_url: str, keys: Keys) -> None:
    async def main() -> None:
        redis = await connect(redis_url)
        try:
            assert await live_heartbeats(redis, keys) == []
            assert await served_models(redis, keys) == set()
            await prepare_fleet(redis, keys)
            beats = await live_heartbeats(redis, keys)
            assert [b.worker_id for b in beats] == ["old", "w1", "w2"]  # not the junk value
            assert beats[0].models == {}
            assert await served_models(redis, keys) == {"a", "b"}
        finally:
            await redis.aclose()

    run(main())


def test_fleet_models_per_model_and_the_default_stream(redis_url: str, keys: Keys) -> None:
    async def main() -> None:
        redis = await connect(redis_url)
        try:
            await prepare_fleet(redis, keys)
            await asyncio.sleep(0.05)  # so the oldest pending entry has an age
            # The registered models: those workers advertise (b has no stream yet), and those
            # a producer queued for unchecked (c).
            assert [s.model for s in await model_streams(redis, keys)] == ["a", "b", "c"]
            assert [s.stream for s in await job_streams(redis, keys)] == [
                keys.jobs,
                *(keys.model_stream(model).stream for model in "abc"),
            ]
            fleet = await fleet_models(redis, keys)
        finally:
            await redis.aclose()
        assert [m.model for m in fleet.models] == ["a", "b", "c"]
        a, b, c = fleet.models
        assert (a.workers, a.free_slots, a.max_concurrency) == (("w1", "w2"), 4, 12)
        assert (a.queue.length, a.queue.lag, a.queue.pending, a.queue.dead_letters) == (5, 3, 2, 1)
        assert a.queue.oldest_pending_seconds is not None
        assert 0.05 <= a.queue.oldest_pending_seconds < 30
        # Served, but never had a stream: zeros, no lag, nothing pending.
        assert (b.workers, b.free_slots, b.max_concurrency) == (("w1",), 2, 2)
        assert (b.queue.length, b.queue.lag, b.queue.pending, b.queue.dead_letters) == (
            0,
            None,
            0,
            0,
        )
        assert b.queue.oldest_pending_seconds is None and not b.queue.group
        # A stream nobody serves: its jobs wait.
        assert (c.workers, c.free_slots, c.max_concurrency) == ((), 0, 0)
        assert (c.queue.length, c.queue.lag, c.queue.pending) == (1, 1, 0)
        default = fleet.default
        assert default.queue.stream == keys.jobs
        assert (default.queue.length, default.queue.pending, default.queue.dead_letters) == (
            2,
            0,
            3,
        )
        assert default.workers == ("old", "w1", "w2")
        assert dict(default.default_models) == {"a": 2}
        assert default.old_workers == ("old",)
        assert not default.disagreement
        assert fleet.model("b") is b and fleet.model("zzz") is None

    run(main())


def test_a_heartbeat_naming_an_invalid_model_is_no_model_row(redis_url: str, keys: Keys) -> None:
    """Such a name has no stream to read: the worker is listed, the name is not a row."""

    async def main() -> None:
        redis = await connect(redis_url)
        try:
            await write_beat(redis, keys, beat("odd", {"not a name": (1, 1), "a": (1, 1)}))
            fleet = await fleet_models(redis, keys)
        finally:
            await redis.aclose()
        assert [m.model for m in fleet.models] == ["a"]
        assert fleet.default.workers == ("odd",)

    run(main())


def test_an_empty_prefix_is_an_empty_fleet(redis_url: str, keys: Keys) -> None:
    async def main() -> None:
        redis = await connect(redis_url)
        try:
            fleet = await fleet_models(redis, keys)
        finally:
            await redis.aclose()
        assert fleet.models == ()
        queue = fleet.default.queue
        assert (queue.length, queue.lag, queue.pending, queue.dead_letters) == (0, None, 0, 0)
        assert fleet.default.default_models == {} and fleet.default.old_workers == ()

    run(main())


def models_cli(redis_url: str, prefix: str, *args: str) -> int:
    return main(["models", "--redis-url", redis_url, "--prefix", prefix, *args])


def test_models_command_prints_a_table_and_warnings(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    async def prepare() -> None:
        redis = await connect(redis_url)
        try:
            await prepare_fleet(redis, keys)
            # A third worker whose default model is `b` (a vision model): the fleet disagrees.
            served = {"a": (1, 1), "b": (1, 1)}
            vision = {"b": ("image", "video")}
            await write_beat(redis, keys, beat("w3", served, default="b", media=vision))
        finally:
            await redis.aclose()

    run(prepare())
    assert models_cli(redis_url, keys.prefix) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "MODEL",
        "WORKERS",
        "FREE/MAX",
        "MEDIA",
        "QUEUED",
        "LAG",
        "PENDING",
        "OLDEST",
        "DEAD",
    ]
    rows = {line.split()[0]: line.split() for line in lines[1:4]}
    assert rows["a"][:7] == ["a", "3", "5/13", "-", "5", "3", "2"]
    assert rows["a"][7].endswith("s") and rows["a"][8] == "1"
    assert rows["b"] == ["b", "2", "3/3", "image,video", "0", "-", "0", "-", "0"]
    assert rows["c"] == ["c", "0", "0/0", "-", "1", "1", "0", "-", "0"]
    # Columns are aligned: every row as wide as the header's last column ends.
    assert len({len(line) for line in lines[:4]}) == 1
    assert lines[4] == (
        f"default stream {keys.jobs}: 2 queued, lag 2, 0 pending, oldest -, 3 dead; "
        "forwarded to a (2 workers), b (1 worker)"
    )
    assert lines[5].startswith("warning: live workers forward jobs naming no model to different")
    assert lines[6].startswith("warning: 1 worker of an older version (old) run jobs of")
    assert len(lines) == 7


def test_models_command_json(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    async def prepare() -> None:
        redis = await connect(redis_url)
        try:
            await prepare_fleet(redis, keys)
        finally:
            await redis.aclose()

    run(prepare())
    assert models_cli(redis_url, keys.prefix, "--json") == 0
    objects = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["model"] for o in objects] == ["a", "b", "c", None]
    a = objects[0]
    assert {k: v for k, v in a.items() if k != "oldest_pending_seconds"} == {
        "model": "a",
        "stream": keys.model_stream("a").stream,
        "workers": ["w1", "w2"],
        "free_slots": 4,
        "max_concurrency": 12,
        "media": [],  # text only
        "length": 5,
        "lag": 3,
        "pending": 2,
        "dead_letters": 1,
        "tenants": [],  # fair share never on
    }
    assert isinstance(a["oldest_pending_seconds"], float)
    assert objects[1]["oldest_pending_seconds"] is None and objects[1]["lag"] is None
    assert objects[3] == {
        "model": None,
        "workers": ["old", "w1", "w2"],
        "stream": keys.jobs,
        "length": 2,
        "lag": 2,
        "pending": 0,
        "oldest_pending_seconds": None,
        "dead_letters": 3,
        "default_models": {"a": 2},
        "old_workers": ["old"],
    }


def test_models_command_on_an_empty_prefix(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    assert models_cli(redis_url, keys.prefix) == 0
    assert capsys.readouterr().out.splitlines() == [
        "no live worker serves a model, and no model has a job stream",
        f"default stream {keys.jobs}: 0 queued, lag -, 0 pending, oldest -, 0 dead; "
        "forwarded to no live worker",
    ]


def test_models_command_exits_2_when_redis_is_unreachable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert models_cli(f"redis://127.0.0.1:{free_port()}/0", "p") == 2
    assert "cannot connect to Redis" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_fleet_models_finds_model_streams_on_every_cluster_node(
    redis_cluster: LocalCluster, prefix: str
) -> None:
    """Model streams hash by the model's name: on a 3-master Cluster, names chosen to land on
    different nodes are all found (the registry names them), with their queues and dead
    letters read on their own nodes; heartbeats too live on several nodes."""
    keys = Keys(prefix)

    async def main() -> None:
        redis = await connect(redis_cluster.url)
        try:
            nodes: dict[str, str] = {}  # node -> a model whose stream lives there
            for i in range(200):
                model = f"m{i}"
                node = redis.get_node_from_key(keys.model_stream(model).stream)
                nodes.setdefault(node.name, model)
                if len(nodes) == 3:
                    break
            models = sorted(nodes.values())
            assert len(models) == 3
            for index, model in enumerate(models):
                await queue_jobs(redis, keys.model_stream(model), total=index + 1, delivered=1)
                await redis.xadd(keys.model_stream(model).dead, {"job": b"x"})
                await register_model(redis, keys, model)
            workers = [f"w{i}" for i in range(12)]
            for worker in workers:
                await write_beat(redis, keys, beat(worker, {models[0]: (1, 2)}))
            slots = {key_slot(keys.worker(w).encode()) for w in workers}
            assert len({redis.nodes_manager.get_node_from_slot(s).name for s in slots}) > 1
            assert [s.model for s in await model_streams(redis, keys)] == models
            assert {b.worker_id for b in await live_heartbeats(redis, keys)} == set(workers)
            fleet = await fleet_models(redis, keys)
        finally:
            await redis.aclose()
        assert [m.model for m in fleet.models] == models
        for index, status in enumerate(fleet.models):
            assert (status.queue.length, status.queue.pending, status.queue.dead_letters) == (
                index + 1,
                1,
                1,
            )
            assert status.queue.oldest_pending_seconds is not None
        assert fleet.models[0].workers == tuple(sorted(workers))
        assert fleet.models[0].free_slots == 12
        assert fleet.default.queue.length == 0

    run(main())
