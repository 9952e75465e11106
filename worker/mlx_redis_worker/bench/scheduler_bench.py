"""``mlx-worker bench scheduler``: the engine's own host work per token, without the model.

The scheduler runs for real (admission, token bookkeeping, mlx-lm's streaming detokenizer, stop
checks, building ``RequestOutput``s) while a replay stands in for ``BatchGenerator``: it answers
each step with tokens drawn in advance from the tokenizer's vocabulary, so the time measured is
what the engine adds on top of the model, the part that decides how close a host-bound step
(small model, large batch, fast GPU) comes to raw mlx-lm. Baseline, same run: mlx-lm's
streaming detokenizer alone on the same tokens (work any server that returns text must do).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any, cast

from mlx_redis_worker.bench.engine_bench import make_prompts
from mlx_redis_worker.engine import Request, SamplingParams, Scheduler, SchedulerConfig
from mlx_redis_worker.engine.decode_batches import DecodePlan
from mlx_redis_worker.engine.speculative_batch import (
    SpeculativeBatchGenerator,
    SpeculativeResponse,
)
from mlx_redis_worker.models import load_model


class ReplayGenerator:
    """Answers the scheduler like ``PhasedBatchGenerator``, with tokens decided in advance:
    no prompt to process, every sequence decoding from the first step."""

    def __init__(self, tokens: list[list[int]]) -> None:
        self._tokens = tokens
        self._uids: list[int] = []
        # Each sequence's next token (the scheduler admits a few sequences a step: each starts
        # at its own first token and ends at its own last).
        self._next: list[int] = []
        self.last_decode_plan = DecodePlan()  # one batch, every step

    def insert_segments(self, segments: list[list[list[int]]], **_: Any) -> list[int]:
        uid = len(self._uids)
        self._uids.append(uid)
        self._next.append(0)
        return [uid]

    has_prefill_work = False
    num_prefilling = 0

    @property
    def num_decoding(self) -> int:
        return sum(n < len(self._tokens[uid]) for uid, n in enumerate(self._next))

    def prefill(self, budget: int | None = None) -> list[Any]:
        return []

    def start_generation(self) -> list[Any]:
        return []

    def decode(self, sides: bool = True) -> list[Any]:
        responses = []
        for uid in self._uids:
            step, tokens = self._next[uid], self._tokens[uid]
            if step == len(tokens):
                continue  # finished
            self._next[uid] = step + 1
            reason = "length" if step == len(tokens) - 1 else None
            responses.append(SpeculativeResponse(uid, tokens[step], None, reason, None, None))
        return responses

    def close(self) -> None:
        pass


def run_scheduler(tokenizer: Any, tokens: list[list[int]], stream_interval: int) -> float:
    """Seconds for the scheduler to take every sequence through all its tokens."""
    scheduler = Scheduler(
        None, tokenizer, SchedulerConfig(max_num_seqs=len(tokens), enable_prefix_cache=False)
    )
    scheduler._generator = cast(SpeculativeBatchGenerator, ReplayGenerator(tokens))
    params = SamplingParams(max_tokens=len(tokens[0]), temperature=0.0)
    start = time.perf_counter()
    for i in range(len(tokens)):
        scheduler.add_request(Request(f"r{i}", [1], params, stream_interval=stream_interval))
    outputs = 0
    while scheduler.has_requests():
        outputs += len(scheduler.step().outputs)
    seconds = time.perf_counter() - start
    expected = len(tokens) * (len(tokens[0]) if stream_interval == 1 else 1)
    if outputs != expected:
        raise RuntimeError(f"expected {expected} outputs, got {outputs}")
    return seconds


def run_detokenizer(tokenizer: Any, tokens: list[list[int]]) -> float:
    start = time.perf_counter()
    detokenizers = [tokenizer.detokenizer for _ in tokens]
    for step in range(len(tokens[0])):
        for detokenizer, sequence in zip(detokenizers, tokens, strict=True):
            detokenizer.add_token(sequence[step])
            _ = detokenizer.last_segment
    for detokenizer in detokenizers:
        detokenizer.finalize()
    return time.perf_counter() - start


def run_scheduler_bench(args: argparse.Namespace) -> int:
    _, tokenizer = load_model(args.model)
    # Ordinary tokens, drawn like the engine bench's prompts: none of them ends a sequence.
    tokens = make_prompts(tokenizer, args.sequences, args.tokens)
    paths: dict[str, Callable[[], float]] = {
        "mlx-lm streaming detokenizer alone (baseline)": lambda: run_detokenizer(tokenizer, tokens),
        "scheduler, one output per token": lambda: run_scheduler(tokenizer, tokens, 1),
        "scheduler, one output per request": lambda: run_scheduler(
            tokenizer, tokens, args.tokens + 1
        ),
    }
    per_token: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.repeat):  # A B C A B C ...: drift hits every path alike
        for name, run in paths.items():
            per_token[name].append(run() / (args.sequences * args.tokens) * 1e6)
    print(
        f"model {args.model} (tokenizer {type(tokenizer.detokenizer).__name__}), "
        f"{args.sequences} sequences x {args.tokens} tokens, {args.repeat} rotations"
    )
    print("| path | µs / token (median, min–max) | / baseline |")
    print("|---|---:|---:|")
    baseline = per_token[next(iter(paths))]
    for name, values in per_token.items():
        ratio = statistics.median(v / b for v, b in zip(values, baseline, strict=True))
        print(
            f"| {name} | {statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f}) "
            f"| {ratio:.2f}x |"
        )
    return 0
