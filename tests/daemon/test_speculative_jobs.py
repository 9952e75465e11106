"""Jobs asking for speculative decoding, or not, through a real worker (the tiny model) whose
default is on: each job's choice reaches the engine and the output is the plain one."""

from __future__ import annotations

import pytest

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent
from tests.daemon.helpers import check_stream, collect
from tests.support.processes import WorkerFactory
from tests.support.waiting import run

PROMPT = "the cat sat on the mat and then the cat sat on the mat again and again"


@pytest.mark.timeout(120)
def test_a_jobs_speculative_field_and_the_worker_default(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    workers.start("w1", env={"MLXW_SPECULATIVE": "prompt_lookup:4"})

    async def main() -> None:
        async with Client(redis_url, prefix=prefix) as client:

            async def one(**options: object) -> tuple[str, dict[str, int]]:
                rid = await client.submit(
                    PROMPT,
                    max_tokens=32,
                    temperature=0.0,
                    **options,  # type: ignore[arg-type]
                )
                terminal = check_stream(await collect(client, rid), rid).terminal
                assert isinstance(terminal, DoneEvent), terminal
                (reply,) = await client.stats()
                assert reply.ok, reply.error
                return terminal.output_text, reply.result["engine"]["speculation"]

            off, after_off = await one(speculative={"method": "off"})
            assert after_off["steps"] == 0  # the job said off: the default did not apply
            default, after_default = await one()
            assert after_default["steps"] > 0 and after_default["accepted_tokens"] > 0
            two, after_two = await one(
                speculative={"method": "prompt_lookup", "num_draft_tokens": 2}
            )
            new_drafts = after_two["draft_tokens"] - after_default["draft_tokens"]
            new_rows = after_two["rows"] - after_default["rows"]
            assert 0 < new_drafts <= 2 * new_rows  # at most 2 drafts per row, as asked
            assert default == off and two == off

    run(main())
