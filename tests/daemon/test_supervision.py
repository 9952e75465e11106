"""No task dies silently: a failing task is logged at once and restarted, and the heartbeat
offers no capacity that nothing serves.

The real case: the worker's ACL revoked for a few seconds, then restored. Every task that
touches Redis is refused (NOPERM); before, its job reader and reclaimer died with no log line
and the worker never served again, while its heartbeat kept advertising free slots."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import redis

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.heartbeat import Heartbeat, decode_heartbeat
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import DoneEvent
from mlx_redis_protocol.supervisor import supervise
from tests.daemon.helpers import check_stream, collect
from tests.support.acl import MakeUser, documented_minimum_acl
from tests.support.environment import FAST_RECLAIM
from tests.support.processes import MODEL, WorkerFactory
from tests.support.waiting import run, wait_until

REVOKED_SECONDS = 5.0


def test_supervise_logs_the_first_failure_at_once_and_restarts_until_it_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Three failures in a row: one error line (the burst's first), the task in ``down``
    meanwhile, then the fourth start runs: one recovery line, ``down`` empty; a cancel
    stops it."""
    starts: list[float] = []
    down: set[str] = set()
    seen_down: list[bool] = []

    async def flaky() -> None:
        starts.append(time.monotonic())
        seen_down.append("reader" in down)
        if len(starts) <= 3:
            raise PermissionError("NOPERM this user has no permissions")
        await asyncio.sleep(3600)

    async def main() -> None:
        task = asyncio.create_task(
            supervise("reader", flaky, down=down, healthy_after=0.2, first_delay=0.01)
        )
        while "reader" in down or len(starts) < 4:
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.INFO, logger="mlx_redis_protocol.supervisor"):
        run(main())
    assert len(starts) == 4
    assert seen_down == [False, True, True, True]
    assert not down
    lines = [(r.getMessage(), r.levelname) for r in caplog.records]
    assert lines == [("task_failed_restarting", "ERROR"), ("task_recovered", "INFO")]
    failed = caplog.records[0]
    assert failed.task == "reader"  # type: ignore[attr-defined]
    assert "NOPERM" in failed.error  # type: ignore[attr-defined]


@pytest.mark.timeout(240)
def test_a_revoked_then_restored_acl_is_logged_and_the_worker_serves_again(
    workers: WorkerFactory,
    redis_url: str,
    prefix: str,
    admin: redis.Redis,
    acl_user: MakeUser,
) -> None:
    rules = documented_minimum_acl(prefix)
    user, url = acl_user(rules)
    worker = workers.start("revoked", redis_url=url, env=FAST_RECLAIM)
    heartbeat_key = Keys(prefix).worker("revoked")

    def advertised() -> Heartbeat | None:
        return decode_heartbeat(admin.get(heartbeat_key))

    async def one_job() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            rid = await client.submit("still there?", max_tokens=6, temperature=0.0)
            summary = check_stream(await collect(client, rid, timeout=90), rid)
            assert isinstance(summary.terminal, DoneEvent), summary.terminal

    run(one_job())
    admin.execute_command("ACL", "SETUSER", user, "-@all")
    revoked_at = time.monotonic()

    def refusal_logged() -> bool:
        return any(
            e.get("event") == "task_failed_restarting"
            and e.get("level") == "error"
            and "NoPermissionError" in str(e.get("error"))
            for e in worker.log_events()
        )

    wait_until(refusal_logged, 30, lambda: f"a refusal logged:\n{worker.log_tail()}")
    # Its heartbeat is refused too: it expires, and nothing advertises the worker's slots.
    wait_until(lambda: advertised() is None, 15, "the heartbeat gone while refused")
    time.sleep(max(0.0, REVOKED_SECONDS - (time.monotonic() - revoked_at)))
    admin.execute_command("ACL", "SETUSER", user, "reset", *rules)

    run(one_job())  # served again, by the same process
    worker.check_running()
    assert worker.starts == 1

    def full_capacity() -> bool:
        beat = advertised()
        return beat is not None and beat.models[MODEL].free_slots == 4

    wait_until(full_capacity, 30, "the heartbeat offering its slots again")
    recovered = {e.get("task") for e in worker.log_events() if e.get("event") == "task_recovered"}
    assert f"consumer {MODEL}" in recovered, recovered
