"""With fair share on, the worker also tries the commands of its pick script at start, and
the documented ACL line for fair share is enough (real ACL users, real worker processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent
from tests.daemon.helpers import check_stream, collect
from tests.support.acl import (
    PASSWORD,
    MakeUser,
    denials,
    documented_minimum_acl,
    refusal_line,
    start_refused,
)
from tests.support.processes import WorkerFactory
from tests.support.waiting import run


@pytest.mark.parametrize(
    ("rule", "command", "needed_to"),
    [
        ("-zincrby", "ZINCRBY", "pick jobs by fair share"),
        ("-xread", "XREAD", "wait for new jobs (fair share)"),
        ("-hdel", "HDEL", "copy tenant weights"),
    ],
)
def test_a_missing_fair_share_command_is_named_before_the_model_loads(
    acl_user: MakeUser,
    admin: redis.Redis,
    prefix: str,
    tmp_path: Path,
    rule: str,
    command: str,
    needed_to: str,
) -> None:
    user, url = acl_user(["on", f">{PASSWORD}", f"~{prefix}:*", f"&{prefix}:*", "+@all", rule])
    line = refusal_line(start_refused(url, prefix, tmp_path, "--fair-share"))
    assert line == (
        f"mlx-worker: Redis user {user!r} may not run {command} (needed to {needed_to}); "
        "grant it (see docs/redis.md: minimum ACL)"
    )
    assert len(denials(admin, user)) == 1


@pytest.mark.timeout(180)
def test_the_documented_fair_share_acl_serves_a_tenants_job(
    acl_user: MakeUser, admin: redis.Redis, workers: WorkerFactory, prefix: str
) -> None:
    user, url = acl_user(documented_minimum_acl(prefix, fair_share=True))
    workers.start("acl-fair", redis_url=url, env={"MLXW_FAIR_SHARE": "1"})

    async def main() -> None:
        async with Client(url, prefix=prefix) as client:
            rid = await client.submit("hello there", max_tokens=8, tenant="team-a")
            summary = check_stream(await collect(client, rid), rid)
            assert isinstance(summary.terminal, DoneEvent), summary.terminal
            (reply,) = await client.stats()  # the tenants' figures, read under the ACL too
            assert reply.ok and isinstance(reply.result["tenants"], list), reply

    run(main())
    assert denials(admin, user) == [], denials(admin, user)
