"""Control commands against real workers: stats, prefix-cache save/load/clear, ping."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from protocol.client import Client
from protocol.messages import DoneEvent, ErrorEvent
from tests.daemon.helpers import WorkerFactory, prompts, run, settled, until

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
    texts = prompts(4, seed=71)

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
    system = {"role": "system", "content": " ".join(prompts(12, seed=5))}

    async def scenario() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            done = []
            for question in prompts(3, seed=9):  # one at a time: each finds the previous entry
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
