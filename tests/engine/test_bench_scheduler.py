"""`mlx-worker bench scheduler`: its replay drives the real scheduler through every token."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from mlx_redis_worker.bench.engine_bench import make_prompts
from mlx_redis_worker.bench.scheduler_bench import run_scheduler


def test_replay_yields_one_output_per_token_or_per_request(tiny_model: Any) -> None:
    _, tokenizer = tiny_model
    # More sequences than the scheduler admits in one step: the later ones start later and
    # still get every token.
    tokens = make_prompts(tokenizer, 12, 16, seed=3)
    # run_scheduler raises when the scheduler's outputs do not match the replayed tokens.
    assert run_scheduler(tokenizer, tokens, stream_interval=1) > 0
    assert run_scheduler(tokenizer, tokens, stream_interval=17) > 0


def test_cli_prints_the_table() -> None:
    # A process of its own: the CLI configures logging for the whole process.
    args = ["bench", "scheduler", "--sequences", "2", "--tokens", "8", "--repeat", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "mlx_redis_protocol.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "scheduler, one output per token" in done.stdout and "1.00x" in done.stdout
