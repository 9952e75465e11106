"""A producer process of the chaos run: submits its share of the jobs at a steady rate and
follows each request to its end, surviving Redis restarts; writes what it saw as JSON.

``python -m tests.reliability.producer PLAN.json RESULT.json`` (the chaos driver writes the
plan: Redis URL, prefix, rate, and the job entries as base64 bytes).
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from pathlib import Path
from typing import Any

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent
from tests.reliability.streams import Followed, follow, submit_raw
from tests.support.events import terminal_summary, text_after_last_reset

MAX_FOLLOWING = 96  # concurrent subscriptions per producer (one pub/sub connection each)


async def produce(plan: dict[str, Any]) -> list[dict[str, Any]]:
    specs = plan["specs"]
    interval = 1.0 / plan["rate"] if plan["rate"] > 0 else 0.0
    results: list[dict[str, Any]] = []
    slots = asyncio.Semaphore(MAX_FOLLOWING)
    async with Client(
        plan["url"], prefix=plan["prefix"], max_connections=4 * MAX_FOLLOWING
    ) as client:

        async def one(spec: dict[str, Any], submitted_at: float, failures: int) -> None:
            try:
                followed = (
                    await follow(
                        client,
                        spec["rid"],
                        event_timeout=plan["event_timeout"],
                        give_up_after=plan["give_up_after"],
                    )
                    if spec["follow"]
                    else None
                )
            finally:
                slots.release()
            results.append(_result(spec, submitted_at, failures, followed))

        tasks = []
        start = time.monotonic()
        for index, spec in enumerate(specs):
            delay = start + index * interval - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            submitted_at = time.time()
            failures = await submit_raw(
                client, base64.b64decode(spec["data"]), spec["rid"] if spec["follow"] else None
            )
            tasks.append(asyncio.create_task(one(spec, submitted_at, failures)))
        await asyncio.gather(*tasks)
    return results


def _result(
    spec: dict[str, Any], submitted_at: float, failures: int, followed: Followed | None
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "rid": spec["rid"],
        "submitted_at": submitted_at,
        "submit_failures": failures,
    }
    if followed is None:
        return result
    terminal = followed.terminal
    result.update(
        seqs=followed.seqs,
        attempts=[event.attempt for event in followed.events],
        types=[type(event).__name__ for event in followed.events],
        final_text=text_after_last_reset(followed.events),
        output_text=terminal.output_text if isinstance(terminal, DoneEvent) else None,
        terminal=None if terminal is None else terminal_summary(terminal),
        ended_at=followed.ended_at,
        reconnects=followed.reconnects,
        duplicates=followed.duplicates,
        replay_skipped=followed.replay_skipped,
        error=followed.error,
    )
    return result


def main(argv: list[str]) -> int:
    plan = json.loads(Path(argv[0]).read_text())
    results = asyncio.run(produce(plan))
    Path(argv[1]).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
