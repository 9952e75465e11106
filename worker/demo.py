"""``mlx-worker demo``: a few chat requests streamed side by side through one EngineCore.

On a terminal each request gets a line that fills in as its tokens arrive; in a log (no TTY)
each delta is printed as it arrives, tagged with its request. Ends with per-request figures and
the engine's stats.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time

from worker.engine import EngineConfig, EngineCore, RequestOutput, SamplingParams
from worker.models import load_model

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clean Python code.",
    "Explain in one paragraph what a Redis stream is.",
    "Write a haiku about the sea.",
]


class SideBySide:
    """Live view of several streams: redrawn lines on a TTY, tagged deltas otherwise."""

    def __init__(self, labels: list[str]) -> None:
        self.labels = labels
        self.texts = ["" for _ in labels]
        self.live = sys.stdout.isatty()
        self._last_draw = 0.0
        if self.live:
            sys.stdout.write("\n" * len(labels))

    def update(self, index: int, delta: str) -> None:
        self.texts[index] += delta
        if not self.live:
            if delta:
                print(f"[{index + 1}] {delta!r}", flush=True)
            return
        now = time.monotonic()
        if now - self._last_draw > 0.05:
            self.draw()
            self._last_draw = now

    def draw(self) -> None:
        if not self.live:
            return
        width = shutil.get_terminal_size().columns - 1
        lines = []
        for label, text in zip(self.labels, self.texts, strict=True):
            flat = " ".join(text.split())
            line = f"{label} {flat}"
            lines.append(line if len(line) <= width else "…" + line[-(width - 1) :])
        sys.stdout.write(f"\x1b[{len(lines)}F" + "".join(f"\x1b[2K{x}\n" for x in lines))
        sys.stdout.flush()


async def stream_all(
    engine: EngineCore, prompts: list[str], params: SamplingParams
) -> list[RequestOutput]:
    view = SideBySide([f"[{i + 1}]" for i in range(len(prompts))])
    ids = [await engine.add_request(prompt, params) for prompt in prompts]

    async def follow(index: int, request_id: str) -> RequestOutput:
        final = None
        async for output in engine.stream_outputs(request_id):
            view.update(index, output.new_text)
            final = output
        assert final is not None
        return final

    finals = await asyncio.gather(*(follow(i, rid) for i, rid in enumerate(ids)))
    view.draw()
    return list(finals)


def run_demo(args: argparse.Namespace) -> int:
    print(f"loading {args.model} ...", flush=True)
    model, tokenizer = load_model(args.model)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        for question in QUESTIONS
    ]
    engine = EngineCore(model, tokenizer, EngineConfig(model_name=args.model))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)

    async def main() -> list[RequestOutput]:
        await engine.start()
        try:
            return await stream_all(engine, prompts, params)
        finally:
            await engine.stop()

    try:
        for i, question in enumerate(QUESTIONS):
            print(f"[{i + 1}] {question}")
        print()
        finals = asyncio.run(main())
        print()
        for i, final in enumerate(finals):
            print(_summary(i, final))
        stats = engine.get_stats()
        print(
            f"engine: {stats['steps_executed']} steps, {stats['total_completion_tokens']} tokens "
            f"generated, healthy={stats['health']['healthy']}"
        )
    finally:
        engine.close()
    return 0


def _summary(index: int, output: RequestOutput) -> str:
    ttft = f"{output.ttft * 1000:.0f} ms" if output.ttft is not None else "-"
    return (
        f"[{index + 1}] {output.completion_tokens} tokens, finish={output.finish_reason}, "
        f"TTFT {ttft}, {output.tokens_per_second:.1f} tok/s: {output.output_text!r}"
    )
