"""The fleet's registry against a real worker on a private redis-server: the request path (a
broadcast control command, a submit naming a model, the catalogue) runs no keyspace scan
however many unrelated keys Redis holds; a worker registers while it lives and leaves the
registry when it stops.

Redis counts every command it runs (``INFO commandstats``, reset with ``CONFIG RESETSTAT``), of
every client, the worker's included: before the registry, the catalogue and the reply counting
sent ``SCAN`` once per 1000 keys of the database."""

from __future__ import annotations

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
