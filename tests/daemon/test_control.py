"""Control commands against real workers: stats, prefix-cache save/load/clear, ping."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest

from mlx_redis_protocol.cli import main as cli_main
from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent, ErrorEvent
from mlx_redis_worker.engine.fingerprint import model_fingerprint
from mlx_redis_worker.models import load_model
from tests.daemon.helpers import settled
from tests.support.processes import WorkerFactory
from tests.support.prompts import random_prompts
from tests.support.waiting import run, until

MAX_TOKENS = 8
REFUSED_NAMES = ("../x", "/etc/x", "a/b", "..", "x..y", "_x/../../y")


def _files_under(directory: Path) -> set[Path]:
    return {path for path in directory.rglob("*") if path.is_file()}


@pytest.mark.timeout(120)
def test_cache_save_and_load_through_control(
    workers: WorkerFactory, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """cache_save after a few jobs writes only inside --cache-dir; refused names answer
    invalid_field; a missing name answers not_found; a fresh worker loads the saved cache and
    reuses it; stats carry engine, group and publisher numbers."""
    cache_dir = tmp_path / "caches"
    outside_before = _files_under(tmp_path)
    first = workers.start("c1", cache_dir=cache_dir)
    texts = random_prompts(4, seed=71)

    async def warm_up_and_save() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            # Concurrent jobs, so one engine step carries several requests' events.
            done = await asyncio.gather(
                *(client.generate(t, max_tokens=MAX_TOKENS, temperature=0.0) for t in texts)
            )
            assert all(isinstance(d, DoneEvent) for d in done)
            # The worker acknowledges right after writing done: wait for that.
            await until(lambda: settled(client), 10, "entries acknowledged")

            (reply,) = await client.ping()
            assert reply.ok and reply.worker_id == "c1" and reply.result["pong"] is True

            (reply,) = await client.stats()
            assert reply.ok, reply.error
            stats = reply.result
            engine = stats["engine"]
            assert engine["model_name"] == "tiny"
            assert engine["steps_executed"] >= MAX_TOKENS
            assert engine["num_requests_processed"] == len(texts)
            assert stats["prefix_cache"]["entries"] > 0
            group = stats["group"]
            assert group["name"] == prefix
            assert group["pending"] == 0
            assert group["lag"] == 0
            assert group["entries-read"] == len(texts)
            publisher = stats["publisher"]
            assert 0 < publisher["round_trips"] <= publisher["steps"], publisher
            # One pipelined round trip per step carries every request's events of that step.
            assert publisher["events_published"] > publisher["round_trips"], publisher
            assert stats["jobs"]["outcomes"] == {"completed": len(texts)}

            (reply,) = await client.cache_save("warm")
            assert reply.ok, reply.error
            assert reply.result["saved"] is True
            assert reply.result["name"] == "warm"
            assert reply.result["entries"] > 0

            for name in REFUSED_NAMES:
                (reply,) = await client.cache_save(name)
                assert not reply.ok, name
                assert reply.error is not None and reply.error.code == "invalid_field", (
                    name,
                    reply.error,
                )
                (reply,) = await client.cache_load(name)
                assert not reply.ok and reply.error.code == "invalid_field", (name, reply.error)

            (reply,) = await client.cache_load("missing")
            assert not reply.ok
            assert reply.error.code == "not_found"

    run(warm_up_and_save())
    saved = _files_under(cache_dir)
    assert saved and all(path.is_relative_to(cache_dir / "warm") for path in saved)
    new_outside = _files_under(tmp_path) - outside_before - saved
    assert all(path.name.startswith("worker-") for path in new_outside), new_outside
    assert not Path("/etc/x").exists()

    first.signal(signal.SIGTERM)
    assert first.wait(30) == 0
    workers.start("c2", cache_dir=cache_dir)

    async def load_and_reuse() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            (reply,) = await client.stats()
            assert reply.result["prefix_cache"]["entries"] == 0  # a fresh worker: empty

            (reply,) = await client.cache_load("warm")
            assert reply.ok, reply.error
            assert reply.result["loaded"] > 0

            done = await client.generate(texts[0], max_tokens=MAX_TOKENS, temperature=0.0)
            assert isinstance(done, DoneEvent)
            assert done.usage.cached_tokens > 0  # the prompt's prefix came from the loaded cache

            (reply,) = await client.cache_clear()
            assert reply.ok, reply.error
            assert reply.result["cleared"]["prefix_cache_entries"] > 0
            (reply,) = await client.stats()
            assert reply.result["prefix_cache"]["entries"] == 0

    run(load_and_reuse())


@pytest.mark.timeout(120)
def test_chat_jobs_share_their_system_prompt_through_prefix_boundary(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    """Chat jobs marked ``prefix_boundary="system"`` reuse one cache entry of their common
    system turn; a boundary past the prompt is that job's error, and the worker goes on."""
    workers.start("p1")
    system = {"role": "system", "content": " ".join(random_prompts(12, seed=5))}

    async def scenario() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            done = []
            # One at a time: each finds the previous entry.
            for question in random_prompts(3, seed=9):
                chat = [system, {"role": "user", "content": question}]
                done.append(
                    await client.generate(
                        messages=chat, max_tokens=4, temperature=0.0, prefix_boundary="system"
                    )
                )
            assert all(isinstance(d, DoneEvent) for d in done), done
            cached = [d.usage.cached_tokens for d in done]  # type: ignore[union-attr]
            assert cached[0] == 0 and cached[1] == cached[2] > 20, cached
            (reply,) = await client.stats()
            assert reply.result["prefix_cache"]["entries"] == 1  # the system turn, once

            failed = await client.generate("short", max_tokens=4, prefix_boundary=10_000)
            assert isinstance(failed, ErrorEvent) and failed.code == "invalid_job", failed
            assert "prefix_boundary" in failed.message
            after = await client.generate("still serving", max_tokens=4)
            assert isinstance(after, DoneEvent)

    run(scenario())


def _cli(redis_url: str, prefix: str, *args: str) -> int:
    verb, *rest = args
    return cli_main(["ctl", verb, "--redis-url", redis_url, "--prefix", prefix, *rest])


@pytest.mark.timeout(180)
def test_cache_of_another_model_is_refused_with_both_fingerprints(
    workers: WorkerFactory,
    redis_url: str,
    prefix: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A cache saved by the tiny llama, loaded by a worker serving another model (tiny-micro),
    answers incompatible_cache naming the saved and the loading model's fingerprints (the CLI
    exits 1); an unreadable manifest answers the same code with the reason; the model that
    saved it loads it."""
    cache_dir = tmp_path / "caches"
    workers.start("same", cache_dir=cache_dir)

    async def warm_up_and_save() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            for text in random_prompts(2, seed=13):
                done = await client.generate(text, max_tokens=MAX_TOKENS, temperature=0.0)
                assert isinstance(done, DoneEvent), done
            (reply,) = await client.cache_save("warm", worker_id="same")
            assert reply.ok and reply.result["entries"] > 0, reply

    run(warm_up_and_save())
    saved_fingerprint = json.loads((cache_dir / "warm" / "manifest.json").read_text())[
        "fingerprint"
    ]
    other_fingerprint = model_fingerprint(*load_model("tiny-micro"))
    assert saved_fingerprint != other_fingerprint
    # Another model, with the worker's own concurrency and lease.
    workers.start(
        "other", model="tiny-micro", cache_dir=cache_dir, max_concurrency=None, lease_seconds=None
    )
    broken = cache_dir / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text("{not json")

    async def load_everywhere() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            (reply,) = await client.cache_load("warm", worker_id="other")
            assert not reply.ok and reply.error is not None
            assert reply.error.code == "incompatible_cache", reply.error
            assert saved_fingerprint in reply.error.message, reply.error.message
            assert other_fingerprint in reply.error.message, reply.error.message
            (reply,) = await client.stats(worker_id="other")
            assert reply.result["prefix_cache"]["entries"] == 0  # nothing of it was taken

            (reply,) = await client.cache_load("broken", worker_id="same")
            assert not reply.ok and reply.error is not None
            assert reply.error.code == "incompatible_cache", reply.error
            assert "manifest.json" in reply.error.message, reply.error.message

            # The model that saved it loads it (after forgetting what it had: duplicates
            # are not counted).
            (reply,) = await client.cache_clear(worker_id="same")
            assert reply.ok, reply.error
            (reply,) = await client.cache_load("warm", worker_id="same")
            assert reply.ok, reply.error
            assert reply.result["loaded"] > 0

    run(load_everywhere())

    capsys.readouterr()
    assert _cli(redis_url, prefix, "cache-load", "warm", "--worker-id", "other") == 1
    out = capsys.readouterr().out
    assert out.startswith("other: error incompatible_cache: cache 'warm': "), out
    assert saved_fingerprint in out and other_fingerprint in out, out
    # Broadcast: the worker that made the cache (no duplicates to add) answers ok, the other
    # refuses, and one refusal is enough for exit status 1. Replies print by worker id.
    assert _cli(redis_url, prefix, "cache-load", "warm") == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("other: error incompatible_cache:"), lines
    assert lines[1] == "same: loaded 0 entries from cache 'warm'", lines
