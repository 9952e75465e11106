"""The fleet's registry against a real worker on a private redis-server: the request path (a
broadcast control command, a submit naming a model, the catalogue) runs no keyspace scan
however many unrelated keys Redis holds; a worker registers while it lives and leaves the
registry when it stops.

Redis counts every command it runs (``INFO commandstats``, reset with ``CONFIG RESETSTAT``), of
every client, the worker's included: before the registry, the catalogue and the reply counting
sent ``SCAN`` once per 1000 keys of the database."""

from __future__ import annotations

import json
import signal

import pytest
import redis

from mlx_redis_protocol.catalogue import fleet_models, served_models
from mlx_redis_protocol.cli import main as cli_main
from mlx_redis_protocol.client import Client
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import DoneEvent
from mlx_redis_worker.local_redis import RedisServer
from tests.daemon.helpers import collect
from tests.support.processes import MODEL, WorkerFactory
from tests.support.waiting import run, wait_until

UNRELATED_KEYS = 20_000  # twenty SCAN round trips' worth, written in a blink


@pytest.mark.timeout(180)
def test_the_request_path_scans_no_keyspace_and_a_stopping_worker_leaves_the_registry(
    workers: WorkerFactory, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = Keys(prefix)
    with RedisServer() as server:
        admin = redis.Redis.from_url(server.url)
        admin.mset({f"other-app:{i}": b"x" for i in range(UNRELATED_KEYS)})
        worker = workers.start("registered", redis_url=server.url)
        wait_until(lambda: admin.zscore(keys.workers, "registered") is not None, 10, "registration")
        admin.config_resetstat()

        async def request_path() -> None:
            async with Client(server.url, prefix=prefix) as client:
                (reply,) = await client.stats(timeout=10)
                assert reply.ok and reply.worker_id == "registered"
                rid = await client.submit("hello", model=MODEL, max_tokens=4, temperature=0.0)
                assert isinstance((await collect(client, rid))[-1], DoneEvent)
                assert await served_models(client.redis, keys) == {MODEL}
                fleet = await fleet_models(client.redis, keys)
                assert [m.model for m in fleet.models] == [MODEL]
                assert fleet.models[0].workers == ("registered",)

        run(request_path())
        url_flags = ["--redis-url", server.url, "--prefix", prefix]
        assert cli_main(["ctl", "stats", *url_flags]) == 0
        assert cli_main(["submit", "hi", "--model", MODEL, "--max-tokens", "2", *url_flags]) == 0
        assert cli_main(["models", *url_flags]) == 0
        capsys.readouterr()
        commands = admin.info("commandstats")
        scans = {name: stat for name, stat in commands.items() if name.endswith(("scan", "keys"))}
        assert not scans, f"keyspace scans on the request path: {scans}"
        assert "cmdstat_zrange" in commands  # the registry was read instead

        assert admin.zscore(keys.models, MODEL) is not None
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0, worker.log_tail()
        assert admin.zscore(keys.workers, "registered") is None
        assert run(_served(server.url, keys)) == set()
        admin.close()


async def _served(url: str, keys: Keys) -> set[str]:
    async with Client(url, prefix=keys.prefix) as client:
        return await served_models(client.redis, keys)


@pytest.mark.timeout(240)
def test_registry_garbage_neither_hides_a_live_worker_nor_floods_a_reader(
    workers: WorkerFactory, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stray SET on the workers' registry, then 4,096 members scored +inf: every `submit
    --model` is still queued (none ends unknown_model) and `models` shows the worker, which
    repairs the key and prunes the members. A heartbeat claiming 20,000 models costs
    `models` a bounded number of commands and lines."""
    keys = Keys(prefix)
    with RedisServer() as server:
        admin = redis.Redis.from_url(server.url)
        live = workers.start("live", redis_url=server.url)
        wait_until(lambda: admin.zscore(keys.workers, "live") is not None, 60, "registration")
        flags = ["--redis-url", server.url, "--prefix", prefix]

        def served_everywhere() -> None:
            submit = ["submit", "hi", "--model", MODEL, "--max-tokens", "2", *flags]
            for _ in range(3):
                assert cli_main(submit) == 0
            capsys.readouterr()
            assert cli_main(["models", "--json", *flags]) == 0
            rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
            assert [r["workers"] for r in rows if r.get("model") == MODEL] == [["live"]]

        admin.delete(keys.workers)
        admin.set(keys.workers, "x")
        served_everywhere()
        assert admin.type(keys.workers) == b"zset"
        admin.zadd(keys.workers, {f"fake-{i}": float("inf") for i in range(4096)})
        served_everywhere()
        wait_until(lambda: admin.zcard(keys.workers) == 1, 30, "the +inf members pruned")

        huge = json.dumps({"worker_id": "big", "models": {f"m{i}": {} for i in range(20_000)}})
        admin.set(keys.worker("big"), huge, px=60_000)
        seconds, micros = admin.time()
        admin.zadd(keys.workers, {"big": seconds * 1000 + micros // 1000 + 60_000})
        many = json.dumps({"worker_id": "many", "models": {f"m{i}": {} for i in range(500)}})
        admin.set(keys.worker("many"), many, px=60_000)
        admin.zadd(keys.workers, {"many": seconds * 1000 + micros // 1000 + 60_000})
        # The live worker paused while `models` is counted: its heartbeats, reclaims and
        # blocked reads would add to Redis' command count as long as `models` takes.
        live.signal(signal.SIGSTOP)
        try:
            admin.config_resetstat()
            assert cli_main(["models", *flags]) == 0
            calls = sum(stat["calls"] for stat in admin.info("commandstats").values())
        finally:
            live.signal(signal.SIGCONT)
        out = capsys.readouterr().out
        assert len(out) < 64 * 1024, len(out)
        # At most 64 models read from a record: 129 models' queues here, 989 commands with
        # the worker paused (its own commands made 1,007 under load before it was); reading
        # 20,000 models' queues would be 80,000 and more.
        assert calls < 2000, calls
        admin.close()
