"""``mlx-worker demo``: the whole system on one machine, in one command.

A Redis (the configured one, else a private redis-server, else an embedded one), a worker
serving SmolLM2 from it, and a producer submitting a few chat prompts at once whose tokens
stream side by side through the client library; then the worker's stats and a clean stop.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DeltaEvent, DoneEvent, ErrorEvent, Event, ResetEvent
from mlx_redis_worker.daemon.settings import WorkerSettings
from mlx_redis_worker.daemon.worker import Worker
from mlx_redis_worker.local_redis import local_redis
from mlx_redis_worker.models import load_model

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clean Python code.",
    "Explain in one paragraph what a Redis stream is.",
    "Write a haiku about the sea.",
]
PREFIX = "mlxw-demo"


class SideBySide:
    """Live view of several streams: redrawn lines on a TTY, tagged deltas otherwise."""

    def __init__(self, count: int) -> None:
        self.texts = ["" for _ in range(count)]
        self.live = sys.stdout.isatty()
        self._last_draw = 0.0
        if self.live:
            sys.stdout.write("\n" * count)

    def show(self, index: int, event: Event) -> None:
        if isinstance(event, ResetEvent):
            self.texts[index] = ""
        elif isinstance(event, DeltaEvent):
            self.texts[index] += event.new_text
            if not self.live and event.new_text:
                print(f"[{index + 1}] {event.new_text!r}", flush=True)
        if self.live and time.monotonic() - self._last_draw > 0.05:
            self.draw()

    def draw(self) -> None:
        if not self.live:
            return
        self._last_draw = time.monotonic()
        width = shutil.get_terminal_size().columns - 1
        lines = []
        for index, text in enumerate(self.texts):
            line = f"[{index + 1}] " + " ".join(text.split())
            lines.append(line if len(line) <= width else "…" + line[-(width - 1) :])
        sys.stdout.write(f"\x1b[{len(lines)}F" + "".join(f"\x1b[2K{x}\n" for x in lines))
        sys.stdout.flush()


async def produce_and_watch(url: str, max_tokens: int) -> int:
    view = SideBySide(len(QUESTIONS))
    async with Client(url, prefix=PREFIX) as client:
        ids = [
            await client.submit(
                messages=[{"role": "user", "content": q}], max_tokens=max_tokens, temperature=0.0
            )
            for q in QUESTIONS
        ]

        async def follow(index: int, request_id: str) -> Event:
            last: Event | None = None
            async for event in client.stream(request_id, timeout=120):
                view.show(index, event)
                last = event
            assert last is not None
            return last

        finals = await asyncio.gather(*(follow(i, rid) for i, rid in enumerate(ids)))
        view.draw()
        print()
        failures = 0
        for index, final in enumerate(finals):
            if isinstance(final, DoneEvent):
                usage = final.usage
                ttft = f"{usage.ttft_ms:.0f} ms" if usage.ttft_ms is not None else "-"
                print(
                    f"[{index + 1}] {usage.completion_tokens} tokens, {final.finish_reason}, "
                    f"TTFT {ttft}, {usage.tokens_per_second:.1f} tok/s: {final.output_text!r}"
                )
            else:
                failures += 1
                message = final.message if isinstance(final, ErrorEvent) else final.type
                print(f"[{index + 1}] failed: {message}")
        replies = await client.stats()
        for reply in replies:
            stats = reply.result or {}
            engine, publisher = stats.get("engine", {}), stats.get("publisher", {})
            print(
                f"worker {reply.worker_id}: {engine.get('total_completion_tokens')} tokens in "
                f"{engine.get('steps_executed')} engine steps, {publisher.get('round_trips')} "
                f"Redis round trips for {publisher.get('events_published')} events, "
                f"jobs {stats.get('jobs', {}).get('outcomes')}, group lag "
                f"{stats.get('group', {}).get('lag')}"
            )
    return 1 if failures else 0


def run_demo(args: argparse.Namespace) -> int:
    configured = os.environ.get("MLXW_REDIS_URL")
    with local_redis(configured, embedded=args.embedded_redis) as (url, what):
        print(f"Redis: {what}")
        print(f"loading {args.model} ...", flush=True)
        model_and_tokenizer = load_model(args.model)
        settings = WorkerSettings(
            model=args.model,
            redis_url=url,
            prefix=PREFIX,
            worker_id="demo-worker",
            log_format="console",
        )

        async def main() -> int:
            worker = Worker(settings, model_and_tokenizer=model_and_tokenizer)
            serving = asyncio.create_task(worker.run())
            await worker.ready.wait()
            print("worker ready; submitting:")
            for index, question in enumerate(QUESTIONS):
                print(f"  [{index + 1}] {question}")
            print()
            try:
                status = await produce_and_watch(url, args.max_tokens)
            finally:
                worker.request_stop()
                worker_status = await serving
            print(f"worker stopped cleanly (exit status {worker_status})")
            return status or worker_status

        return asyncio.run(main())
