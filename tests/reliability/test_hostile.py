"""Hostile input, short profile: 1,000 generated entries (the long profile, 10,000, is
``make chaos``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent
from mlx_redis_worker.local_redis import RedisServer
from tests.reliability.hostile import HostileConfig, run_hostile
from tests.reliability.workers import worker_process
from tests.support.references import tiny_reference

MIB = 1024 * 1024


@pytest.mark.timeout(240)
def test_hostile_entries_are_dead_lettered_and_the_worker_survives(tmp_path: Path) -> None:
    """Every entry the protocol decoder refuses is dead-lettered with the decoder's code and
    the original bytes, and gets an `error` event (invalid_job, the code in its message) when
    it names a readable request id; every job the decoder accepts (absurd sampling values
    included) ends with exactly one terminal event; the valid greedy jobs mixed in come out
    with the reference text; hostile control messages change nothing outside the reply
    lists; the worker never crashes or restarts, answers ping afterwards, stops with 0, and
    its memory stays bounded."""
    result = run_hostile(HostileConfig(entries=1000, seed=7, directory=tmp_path))
    print(result.table())
    assert result.problems == [], result.problems[:20]
    values = result.values
    assert values["bad"] > 700 and values["dead_ok"] == values["bad"]
    assert values["error_events"] > 200
    assert values["valid"] > 20 and values["valid_ok"] == values["valid"]
    assert values["crashes"] == 0
    # Bounded: 1,000 entries (a few of them 1 MiB) may cost allocator arenas, not a leak; the
    # 10,000-entry run peaks within ~50 MiB of this one (README, Reliability).
    assert values["rss_peak"] - values["rss_warm"] < 350 * MIB


@pytest.mark.timeout(120)
def test_a_request_ended_by_its_first_token_gets_a_readable_done(tmp_path: Path) -> None:
    """Found by the 10,000-entry run: when the first sampled token ends a request (EOS or a
    stop token, so 0 completion tokens) the engine reports a negative tokens_per_second, and
    the worker published a `done` event that the protocol's decoder refuses: unreadable for
    every subscriber, and not seen as terminal by a redelivery. Now it reads as done/stop."""
    prompt = "hello there"
    stop = tiny_reference().first_token(prompt)
    server = RedisServer()
    server.start()
    process = worker_process("first-1", server.url, "first", tmp_path).start()
    try:
        process.wait_ready()

        async def main() -> object:
            async with Client(server.url, prefix="first") as client:
                return await client.generate(
                    prompt, max_tokens=4, temperature=0.0, stop_token_ids=[stop], timeout=60
                )

        done = asyncio.run(main())
        assert isinstance(done, DoneEvent), done
        assert done.finish_reason == "stop" and done.usage.completion_tokens == 0, done
        assert done.usage.tokens_per_second == 0.0 and done.output_text == ""
        assert process.stop() == 0
    finally:
        process.kill()
        server.close()
