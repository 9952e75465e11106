"""`mlx-worker bench engine --against vllm-mlx`: the reference engine as a same-run yardstick."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from mlx_redis_worker.bench.engine_bench import (
    VLLM_MLX_PATH,
    PathResult,
    format_ratios,
    make_burst,
    make_chat_prompts,
)
from tests.support.processes import mlx_worker

ARGS = [
    "bench",
    "engine",
    "--model",
    "tiny",
    "--concurrency",
    "2,32",
    "--max-tokens",
    "3",
    "--repeat",
    "1",
    "--skip",
    "sequential,batch,sync",
    "--against",
    "vllm-mlx",
]


def bench(env: dict[str, str] | None = None) -> str:
    # A process of its own: the CLI configures logging for the whole process.
    result = mlx_worker(*ARGS, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    return result.stdout


def test_the_ratios_compare_ttft_and_speed_within_each_rotation() -> None:
    ours = [PathResult("engine add_request + stream_outputs", 4, 40, 2.0, [0.1, 0.2, 0.3, 0.4])]
    vllm = [PathResult(VLLM_MLX_PATH, 4, 40, 4.0, [0.5, 0.5, 0.5, 1.0])]
    text = format_ratios([ours, vllm], [4])
    assert (
        "concurrency 4: engine add_request / vllm-mlx EngineCore: "
        "TTFT avg 0.40x, TTFT p99 0.40x, tok/s 2.00x"
    ) in text


def test_a_mixed_burst_draws_every_length_in_range_the_same_way_each_time(
    tiny_model: Any,
) -> None:
    _, tokenizer = tiny_model
    burst = make_burst(tokenizer, 32, 32, (8, 512), seed=32)
    lengths = [len(p) for p in burst]
    assert all(8 <= n <= 512 for n in lengths)
    assert len(set(lengths)) > 16  # mixed, not one length
    assert burst == make_burst(tokenizer, 32, 32, (8, 512), seed=32)
    assert burst != make_burst(tokenizer, 32, 32, (8, 512), seed=33)
    assert [len(p) for p in make_burst(tokenizer, 4, 32, None, seed=4)] == [32] * 4


def test_a_mixed_length_burst_runs_every_path_on_the_same_prompts() -> None:
    out = mlx_worker(
        "bench", "engine", "--model", "tiny", "--concurrency", "4", "--max-tokens", "3",
        "--repeat", "1", "--skip", "sequential,sync", "--prompt-lengths", "8-64",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "prompts of 8-64 tokens (uniform, seeded)" in out.stdout
    assert "| 4 | engine add_request + stream_outputs | 12 |" in out.stdout
    assert "| 4 | raw mlx-lm BatchGenerator | 12 |" in out.stdout


def test_logprobs_and_sampling_run_as_paths_of_their_own_against_the_same_load_without() -> None:
    out = mlx_worker(
        "bench", "engine", "--model", "tiny", "--concurrency", "4", "--max-tokens", "3",
        "--repeat", "1", "--skip", "sequential,batch,sync", "--logprobs", "20",
        "--temperature", "1",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "| 4 | engine add_request + stream_outputs | 12 |" in out.stdout
    for variant in ("top logprobs 20", "temperature 1"):
        assert f"| 4 | engine streamed with {variant} (same engine) |" in out.stdout
        assert (
            f"concurrency 4: engine streamed with {variant} (same engine) / without tok/s = "
            in out.stdout
        )


def test_chat_prompts_are_distinct_questions_through_the_chat_template(tiny_model: Any) -> None:
    _, tokenizer = tiny_model
    prompts = make_chat_prompts(tokenizer, 12, seed=12)
    assert len({tuple(p) for p in prompts}) == 12
    assert prompts == make_chat_prompts(tokenizer, 12, seed=12)
    text = tokenizer.decode(prompts[3])
    assert "Tell me a story about" in text and "number 3." in text


def test_prompt_lengths_must_be_a_range() -> None:
    for bad in ("8", "0-8", "9-8", "a-b"):
        out = mlx_worker("bench", "engine", "--prompt-lengths", bad)
        assert out.returncode == 2, bad
        assert "want MIN-MAX with 1 <= MIN <= MAX" in out.stderr, bad


def test_without_vllm_mlx_the_bench_says_so_and_runs_the_rest(tmp_path: Path) -> None:
    hidden = tmp_path / "vllm_mlx"
    hidden.mkdir()
    (hidden / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    out = bench({"PYTHONPATH": str(tmp_path)})
    assert "vllm-mlx is not installed (hidden by the test)" in out
    assert "| 2 | engine add_request + stream_outputs | 6 |" in out
    assert "| 32 | engine add_request + stream_outputs | 96 |" in out
    assert "vllm-mlx 0.6" not in out


@pytest.mark.skipif(
    importlib.util.find_spec("vllm_mlx") is None,
    reason="vllm-mlx is an optional install: pip install --no-deps vllm-mlx==0.6.0",
)
def test_the_same_load_runs_through_vllm_mlx_in_a_process_of_its_own() -> None:
    # Concurrency 32 too: with both engines in one process, MLX streams crossed threads there.
    out = bench()
    for level, tokens in ((2, 6), (32, 96)):
        assert f"| {level} | engine add_request + stream_outputs | {tokens} |" in out
        assert f"| {level} | {VLLM_MLX_PATH} | {tokens} |" in out
        assert f"concurrency {level}: engine add_request / vllm-mlx EngineCore: TTFT avg " in out
