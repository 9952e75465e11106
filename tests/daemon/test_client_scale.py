"""One Client following a thousand requests at once, against a real worker."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent
from tests.daemon.helpers import check_stream, collect
from tests.support.processes import WorkerFactory
from tests.support.prompts import random_prompts
from tests.support.references import GreedyReference
from tests.support.waiting import run

STREAMS = 1000
MAX_IN_FLIGHT = 64


@pytest.mark.timeout(300)
def test_one_client_follows_a_thousand_streams_over_a_bounded_pool(
    workers: WorkerFactory, redis_url: str, prefix: str, reference: GreedyReference
) -> None:
    """1,000 jobs submitted and followed concurrently through one Client: every stream is
    complete and correct, while the client never holds more than ``max_in_flight + 2``
    connections, one of them the pub/sub connection that carries all the channels."""
    workers.start("scale-1", max_concurrency=32)
    texts = random_prompts(20, seed=7)
    chosen = [texts[i % len(texts)] for i in range(STREAMS)]
    name = f"{prefix}-client"

    async def scenario() -> tuple[list[Any], dict[str, int]]:
        admin = Redis.from_url(redis_url)
        peak = {"connections": 0, "pubsub_connections": 0, "channels": 0}

        async def sample() -> None:
            while True:
                mine = [c for c in await admin.client_list() if c.get("name") == name]
                subscribed = [int(c.get("sub", 0)) for c in mine if int(c.get("sub", 0)) > 0]
                peak["connections"] = max(peak["connections"], len(mine))
                peak["pubsub_connections"] = max(peak["pubsub_connections"], len(subscribed))
                peak["channels"] = max(peak["channels"], sum(subscribed))
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample())
        try:
            async with Client(
                redis_url, prefix=prefix, max_in_flight=MAX_IN_FLIGHT, client_name=name
            ) as client:
                ids = await asyncio.gather(
                    *(
                        client.submit(prompt, request_id=f"s{i}", max_tokens=2, temperature=0.0)
                        for i, prompt in enumerate(chosen)
                    )
                )
                streams = await asyncio.gather(*(collect(client, rid, timeout=240) for rid in ids))
        finally:
            sampler.cancel()
            await admin.aclose()
        return streams, peak

    streams, peak = run(scenario())
    print(f"peak of the client: {peak}")
    expected = reference.texts(chosen, 2)
    for index, events in enumerate(streams):
        summary = check_stream(events, f"s{index}")
        assert isinstance(summary.terminal, DoneEvent)
        assert summary.terminal.output_text == expected[index]
    assert peak["connections"] <= MAX_IN_FLIGHT + 2, peak
    assert peak["pubsub_connections"] == 1, peak
    assert peak["channels"] >= STREAMS // 2, peak  # the channels really were multiplexed
