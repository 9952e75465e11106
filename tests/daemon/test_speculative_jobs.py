"""Jobs asking for speculative decoding, or not, through a real worker (the tiny model) whose
default is on: each job's choice reaches the engine and the output is the plain one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent, ErrorEvent
from tests.daemon.helpers import check_stream, collect
from tests.support.processes import WorkerFactory
from tests.support.waiting import run

PROMPT = "the cat sat on the mat and then the cat sat on the mat again and again"


async def _generate(
    client: Client, max_tokens: int, **options: object
) -> tuple[str, dict[str, Any]]:
    """PROMPT as a greedy job with ``options`` (``speculative=...``), waited for to its done
    event: its output text, and the worker's speculation stats once it is done."""
    rid = await client.submit(
        PROMPT,
        max_tokens=max_tokens,
        temperature=0.0,
        **options,  # type: ignore[arg-type]
    )
    terminal = check_stream(await collect(client, rid), rid).terminal
    assert isinstance(terminal, DoneEvent), terminal
    (reply,) = await client.stats()
    assert reply.ok, reply.error
    return terminal.output_text, reply.result["engine"]["speculation"]


@pytest.mark.timeout(120)
def test_a_jobs_speculative_field_and_the_worker_default(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    workers.start("w1", env={"MLXW_SPECULATIVE": "prompt_lookup:4"})

    async def main() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            off, after_off = await _generate(client, 32, speculative={"method": "off"})
            assert after_off["steps"] == 0  # the job said off: the default did not apply
            default, after_default = await _generate(client, 32)
            assert after_default["steps"] > 0 and after_default["accepted_tokens"] > 0
            two, after_two = await _generate(
                client, 32, speculative={"method": "prompt_lookup", "num_draft_tokens": 2}
            )
            new_drafts = after_two["draft_tokens"] - after_default["draft_tokens"]
            new_rows = after_two["rows"] - after_default["rows"]
            assert 0 < new_drafts <= 2 * new_rows  # at most 2 drafts per row, as asked
            assert default == off and two == off
            lookup = after_two["prompt_lookup"]  # the stats reply splits by method
            assert lookup["rows"] == after_two["rows"] and lookup["steps"] == after_two["steps"]
            assert after_two["draft_model"]["rows"] == 0
            # This worker has no draft model: a job asking for one is refused, typed.
            rid = await client.submit(PROMPT, max_tokens=8, speculative={"method": "draft_model"})
            refused = check_stream(await collect(client, rid), rid).terminal
            assert isinstance(refused, ErrorEvent) and refused.code == "invalid_job", refused
            assert "no draft model" in refused.message

    run(main())


@pytest.mark.timeout(120)
def test_a_worker_with_a_draft_model_drafts_with_it_by_default(
    workers: WorkerFactory, redis_url: str, prefix: str, tiny_model_path: Path
) -> None:
    """The tiny model as its own draft (named by the environment, loaded like the served
    model): the default draft_model:3 applies and every draft is accepted, same output."""
    env = {"MLXW_SPECULATIVE": "draft_model:3", "MLXW_DRAFT_MODEL": str(tiny_model_path)}
    workers.start("w1", env=env)

    async def main() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            off, _ = await _generate(client, 24, speculative={"method": "off"})
            drafted, speculation = await _generate(client, 24)
            assert drafted == off
            model_rows = speculation["draft_model"]
            assert model_rows["draft_tokens"] == speculation["draft_tokens"] > 0
            assert model_rows["accepted_tokens"] == model_rows["draft_tokens"]
            # The stats reply splits by method: every verify step was a draft-model one.
            assert model_rows["steps"] == speculation["steps"] > 0
            assert model_rows["acceptance_rate"] == 1.0
            assert (
                speculation["prompt_lookup"]["steps"] == speculation["prompt_lookup"]["rows"] == 0
            )

    run(main())
