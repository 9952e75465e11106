"""A fleet of several models: per-model streams, the default stream's forwarding, the
catalogue check, per-model control and stats, and the memory check, against real workers
serving two different offline models (a tiny Llama and a tiny Qwen3) on real Redis servers."""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.codec_job import encode_job
from mlx_redis_protocol.connection import as_text, connect
from mlx_redis_protocol.constants import FORWARDED_FROM_FIELD, JOB_FIELD
from mlx_redis_protocol.control import count_live_workers, count_serving_workers
from mlx_redis_protocol.heartbeat import decode_heartbeat
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import DoneEvent, ErrorEvent, Job
from mlx_redis_worker.daemon.forwarder import DefaultStreamForwarder
from mlx_redis_worker.daemon.job_queue import JobQueue
from mlx_redis_worker.local_redis import LocalCluster, RedisServer
from mlx_redis_worker.local_redis.server import free_port
from tests.support.processes import WorkerFactory, mlx_worker
from tests.support.references import model_reference
from tests.support.waiting import run, until

LLAMA, QWEN = "tiny", "tiny-qwen3"
MAX_TOKENS = 6


def _greedy(model: str, prompts: list[str]) -> list[str]:
    return model_reference(model).texts(prompts, MAX_TOKENS)


@dataclass(frozen=True)
class Pair:
    """A tiny Llama worker (``llama-1``) and a tiny Qwen3 one (``qwen-1``), 4 slots each, the
    fleet's default model Qwen3, under a prefix of their own."""

    redis_url: str
    prefix: str


@pytest.fixture(scope="module")
def pair(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """One pair for the tests that only read what the two workers advertise, answer and run
    (no test stops them or changes their settings): two worker starts instead of six."""
    prefix = f"m{uuid.uuid4().hex[:12]}"
    factory = WorkerFactory(tmp_path_factory.mktemp("pair"), redis_server.url, prefix)
    try:
        env = {"MLXW_DEFAULT_MODEL": QWEN}
        factory.start("llama-1", model=LLAMA, env=env)
        factory.start("qwen-1", model=QWEN, env=env)
        yield Pair(redis_server.url, prefix)
    finally:
        factory.kill_all()
        print(factory.report())


async def _metric_lines(port: int) -> list[str]:
    """The per-model token counters a worker's /metrics serves."""
    url = f"http://127.0.0.1:{port}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
    return [
        line
        for line in body.decode().splitlines()
        if line.startswith("mlxw_tokens_generated_total{")
    ]


async def _heartbeat(client: Client, worker_id: str) -> dict[str, object]:
    beat = decode_heartbeat(await client.redis.get(client.keys.worker(worker_id)))
    assert beat is not None
    return {"models": dict(beat.models), "default": beat.default_model, "version": beat.version}


async def _outputs(client: Client, model: str | None, prompts: list[str]) -> list[DoneEvent]:
    ends = await asyncio.gather(
        *(
            client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, model=model)
            if model is not None
            else client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0)
            for p in prompts
        )
    )
    assert all(isinstance(end, DoneEvent) for end in ends), ends
    return [end for end in ends if isinstance(end, DoneEvent)]


@pytest.mark.timeout(180)
def test_two_workers_two_models(pair: Pair) -> None:
    """Jobs naming a model run on that model's worker (greedy text equal to that model's
    reference), a job naming no model runs on the fleet's default model, and a job for a model
    nobody serves ends with an ``unknown_model`` error within a second, queued nowhere."""
    redis_url, prefix = pair.redis_url, pair.prefix
    prompts = ["The first words", "Counting: one two", "A river runs"]

    async def scenario() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            beats = {w: await _heartbeat(client, w) for w in ("llama-1", "qwen-1")}
            assert list(beats["llama-1"]["models"]) == [LLAMA]  # type: ignore[call-overload]
            assert list(beats["qwen-1"]["models"]) == [QWEN]  # type: ignore[call-overload]
            assert {b["default"] for b in beats.values()} == {QWEN}

            llama = await _outputs(client, LLAMA, prompts)
            qwen = await _outputs(client, QWEN, prompts)
            default = await _outputs(client, None, prompts)
            assert [d.output_text for d in llama] == _greedy(LLAMA, prompts)
            assert [d.output_text for d in qwen] == _greedy(QWEN, prompts)
            assert _greedy(LLAMA, prompts) != _greedy(QWEN, prompts)
            assert [d.output_text for d in default] == [d.output_text for d in qwen]

            loop = asyncio.get_running_loop()
            started = loop.time()
            end = await client.generate("hello", max_tokens=4, model="no-such-model")
            assert loop.time() - started < 1.0
            assert isinstance(end, ErrorEvent) and end.code == "unknown_model", end
            assert LLAMA in end.message and QWEN in end.message
            assert not await client.redis.exists(client.keys.model_stream("no-such-model").stream)

            # Each model's jobs went through its own stream; the default stream was forwarded.
            for model in (LLAMA, QWEN):
                stream = client.keys.model_stream(model)
                info = {
                    row["name"].decode(): row
                    for row in await client.redis.xinfo_groups(stream.stream)
                }
                assert info[prefix]["entries-read"] == len(prompts) * (2 if model == QWEN else 1)
            assert await client.redis.xlen(client.keys.jobs) == 0

    run(scenario())


@pytest.mark.timeout(180)
def test_one_worker_serves_two_models(
    workers: WorkerFactory, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """One worker with both models: both run side by side in their own engines; the
    heartbeat advertises both with their slots; raw producers may queue on the default stream
    with ``model`` (forwarded, timings from the original arrival); a job queued on the wrong
    model's stream is refused; stats, metrics and control commands are per model."""
    port = free_port()
    worker = workers.start(
        "both",
        model=f"{LLAMA},{QWEN}",
        max_concurrency=3,
        env={"MLXW_METRICS_PORT": str(port)},
    )
    keys = Keys(prefix)

    async def scenario() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            beat = await _heartbeat(client, "both")
            assert beat["default"] == LLAMA  # the first --model
            models = beat["models"]
            assert set(models) == {LLAMA, QWEN}  # type: ignore[arg-type]
            assert all(m.max_concurrency == 3 and m.free_slots == 3 for m in models.values())  # type: ignore[attr-defined]

            both = await asyncio.gather(
                _outputs(client, LLAMA, ["Side by side"]), _outputs(client, QWEN, ["Side by side"])
            )
            assert both[0][0].output_text == _greedy(LLAMA, ["Side by side"])[0]
            assert both[1][0].output_text == _greedy(QWEN, ["Side by side"])[0]

            # A raw producer: queued marker-less XADD on the default stream, naming a model.
            job = Job(
                request_id="raw-1",
                prompt="Side by side",
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                model=QWEN,
            )
            entry = await client.redis.xadd(keys.jobs, {JOB_FIELD: encode_job(job)})
            await until(lambda: client.redis.exists(keys.log("raw-1")), 30, "raw job's log")
            end = await client.wait("raw-1", timeout=30)
            assert isinstance(end, DoneEvent) and end.output_text == both[1][0].output_text
            assert end.usage.duration_ms >= 0
            forwarded = await client.redis.xinfo_groups(keys.model_stream(QWEN).stream)
            assert forwarded[0]["entries-read"] == 2
            assert entry  # the original is gone from the default stream
            assert await client.redis.xlen(keys.jobs) == 0

            # The wrong stream: a job naming Llama queued on Qwen's stream.
            wrong = Job(request_id="wrong-1", prompt="x", max_tokens=2, model=LLAMA)
            await client.redis.xadd(keys.model_stream(QWEN).stream, {JOB_FIELD: encode_job(wrong)})
            await until(lambda: client.redis.exists(keys.log("wrong-1")), 30, "wrong job's log")
            end = await client.wait("wrong-1", timeout=30)
            assert isinstance(end, ErrorEvent) and end.code == "invalid_job", end
            assert "queued on the stream of model" in end.message
            assert await client.redis.xlen(keys.model_stream(QWEN).dead) == 1

            (reply,) = await client.stats(model=QWEN)
            assert reply.ok, reply.error
            assert set(reply.result["models"]) == {QWEN}
            assert reply.result["engine"]["total_completion_tokens"] == 2 * MAX_TOKENS
            (reply,) = await client.stats()
            assert set(reply.result["models"]) == {LLAMA, QWEN}

            # A cache save must say which model; with it, only that engine's cache is written.
            (reply,) = await client.cache_save("snap")
            assert not reply.ok and reply.error is not None
            assert reply.error.code == "invalid_field" and "needs model" in reply.error.message
            (reply,) = await client.cache_save("snap", model=LLAMA)
            assert reply.ok and reply.result["model"] == LLAMA, reply
            (reply,) = await client.cache_clear()
            assert set(reply.result["cleared"]) == {LLAMA, QWEN}

            # Metrics carry the model label (refreshed with the heartbeat).
            async def both_counted() -> bool:
                lines = await _metric_lines(port)
                return all(
                    any(f'model="{m}"' in line and not line.endswith(" 0.0") for line in lines)
                    for m in (LLAMA, QWEN)
                )

            await until(both_counted, 20, "per-model token counters in metrics")

    run(scenario())
    text = mlx_worker("ctl", "stats", "--redis-url", redis_url, "--prefix", prefix).stdout
    lines = text.splitlines()
    assert lines[0].startswith(f"both: models {LLAMA}, {QWEN}"), text
    for model in (LLAMA, QWEN):
        (header,) = [line for line in lines if line.startswith(f"  {model}: model {model}")]
        assert "healthy" in header, text
    assert sum(line.strip().startswith("tokens") for line in lines) == 2, text
    assert worker.stop() == 0


@pytest.mark.timeout(120)
def test_control_commands_reach_only_the_models_workers(pair: Pair) -> None:
    """``ping`` with a model is answered by the workers serving it, and the sender waits for
    exactly those (no timeout); without a model, by every worker."""
    redis_url, prefix = pair.redis_url, pair.prefix

    async def scenario() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            # A worker writes its heartbeat, then registers: clients count it once both are.
            redis = await connect(redis_url)
            try:
                for _ in range(600):
                    keys = Keys(prefix)
                    if await count_serving_workers(redis, keys, QWEN) == 1 and (
                        await count_live_workers(redis, keys) == 2
                    ):
                        break
                    await asyncio.sleep(0.05)
            finally:
                await redis.aclose()
            replies = await client.ping(model=QWEN, timeout=5)
            assert [r.worker_id for r in replies] == ["qwen-1"]
            replies = await client.ping(timeout=5)
            assert sorted(r.worker_id for r in replies) == ["llama-1", "qwen-1"]

    run(scenario())


def test_models_that_do_not_fit_are_refused(redis_url: str, prefix: str, tmp_path: Path) -> None:
    """A set of models whose weights exceed the memory limit is refused before loading, with
    one line naming each model's size, and exit status 2."""
    result = mlx_worker(
        "run",
        "--model",
        LLAMA,
        "--model",
        QWEN,
        "--memory-limit-mb",
        "1",
        "--redis-url",
        redis_url,
        "--prefix",
        prefix,
        "--cache-dir",
        str(tmp_path),
    )
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert "the models do not fit" in line and LLAMA in line and QWEN in line, line
    assert "memory_limit_mb" in line


@pytest.mark.timeout(240)
def test_models_on_a_cluster_use_different_slots(
    redis_cluster: LocalCluster, prefix: str, tmp_path: Path
) -> None:
    """On a 3-master Cluster the two models' streams hash to different slots (and nodes), and
    jobs for both, and for the default model, complete there."""
    keys = Keys(prefix)
    llama_slot = key_slot(keys.model_stream(LLAMA).stream.encode())
    qwen_slot = key_slot(keys.model_stream(QWEN).stream.encode())
    assert llama_slot != qwen_slot
    factory = WorkerFactory(tmp_path, redis_cluster.url, prefix)
    try:
        factory.start("cl-llama", model=LLAMA, env={"MLXW_DEFAULT_MODEL": LLAMA})
        factory.start("cl-qwen", model=QWEN, env={"MLXW_DEFAULT_MODEL": LLAMA})

        async def scenario() -> None:
            async with Client(redis_cluster.url, prefix=prefix) as client:
                assert isinstance(client.redis, RedisCluster)
                llama = await _outputs(client, LLAMA, ["On a cluster"])
                qwen = await _outputs(client, QWEN, ["On a cluster"])
                default = await _outputs(client, None, ["On a cluster"])
                assert llama[0].output_text == _greedy(LLAMA, ["On a cluster"])[0]
                assert qwen[0].output_text == _greedy(QWEN, ["On a cluster"])[0]
                assert default[0].output_text == llama[0].output_text

        run(scenario())
    finally:
        factory.kill_all()
        print(factory.report())


def test_models_listing(pair: Pair) -> None:
    """``mlx-worker models`` lists each model with its workers and free slots."""
    args = ["--redis-url", pair.redis_url, "--prefix", pair.prefix, "--json"]
    result = mlx_worker("models", *args)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    by_model = {row.get("model"): row for row in rows}
    assert by_model[LLAMA]["workers"] == ["llama-1"]
    assert by_model[QWEN]["workers"] == ["qwen-1"]
    assert by_model[LLAMA]["free_slots"] == 4


def test_settings_name_the_models() -> None:
    """``--model`` items are ``[NAME=]SOURCE``; names are the fleet's, checked and unique."""
    from mlx_redis_worker.daemon.settings import WorkerSettings

    settings = WorkerSettings(model="tiny, chat=tiny-qwen3,~/models/qwen3-8b/")
    assert [(m.name, m.source) for m in settings.models] == [
        ("tiny", "tiny"),
        ("chat", "tiny-qwen3"),
        ("qwen3-8b", "~/models/qwen3-8b/"),
    ]
    assert settings.default_model_name == "tiny"
    with pytest.raises(ValueError, match="must differ"):
        WorkerSettings(model="tiny,tiny")
    with pytest.raises(ValueError, match="model name"):
        WorkerSettings(model="a{b}=tiny")


@pytest.mark.timeout(120)
def test_a_job_taken_from_the_default_stream_but_not_moved_is_moved_on_restart(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    """A worker killed between taking a default-stream entry and forwarding it holds it
    pending; restarted under its id, it forwards it at once (not after its 60 s lease)."""
    keys = Keys(prefix)

    async def take_without_forwarding() -> str:
        async with Client(redis_url, prefix=prefix) as client:
            await client.redis.xgroup_create(keys.jobs, keys.group, id="0", mkstream=True)
            request_id = await client.submit("held", max_tokens=4, temperature=0.0)
            taken = await client.redis.xreadgroup(keys.group, "fw-1", {keys.jobs: ">"}, count=1)
            assert len(taken[0][1]) == 1
            return request_id

    request_id = run(take_without_forwarding())
    workers.start("fw-1", lease_seconds=60)

    async def finished() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            end = await client.wait(request_id, timeout=30)
            assert isinstance(end, DoneEvent), end

    run(finished())


def test_forwarding_an_entry_again_queues_it_once(redis_url: str, prefix: str) -> None:
    """The default stream's forwarding is safe to repeat: a second forward of the same entry
    (a retry after a lost reply, or another worker that took it over) appends nothing and only
    acknowledges it. The forwarded entry keeps the original id as its arrival."""
    keys = Keys(prefix)

    async def scenario() -> None:
        redis = await connect(redis_url)
        try:
            forwarders = []
            for consumer in ("fw-a", "fw-b"):
                queue = JobQueue(
                    redis=redis, stream=keys.default_stream, consumer=consumer, lease_ms=60_000
                )
                forwarders.append(
                    DefaultStreamForwarder(
                        redis=redis,
                        keys=keys,
                        queue=queue,
                        default_model=LLAMA,
                        read_block_ms=10,
                        marker_ttl=60,
                        stop=asyncio.Event(),
                    )
                )
            await forwarders[0].queue.ensure_group()
            job = Job(request_id="twice", prompt="x", model=QWEN)
            original = as_text(await redis.xadd(keys.jobs, {JOB_FIELD: encode_job(job)}))
            taken = await forwarders[0].queue.read_new(10, 10)
            await forwarders[0].forward(taken)
            await forwarders[0].forward(taken)  # its reply lost: sent again
            await forwarders[1].forward(taken)  # or another worker took the entry over
            entries = await redis.xrange(keys.model_stream(QWEN).stream)
            assert len(entries) == 1
            assert entries[0][1][FORWARDED_FROM_FIELD.encode()] == original.encode()
            assert await redis.xlen(keys.jobs) == 0
            assert await redis.ttl(keys.forwarded(QWEN, original)) > 0
            assert forwarders[0].forwarded + forwarders[1].forwarded == 1
        finally:
            await redis.aclose()

    run(scenario())
