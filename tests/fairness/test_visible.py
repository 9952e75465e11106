"""Fair share is visible: ``ctl stats``, ``mlx-worker models``, the status page and the
Prometheus metrics show each tenant's queued and running work and the tokens it was served,
on a real worker (fair share on, one slot) and a real redis-server."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import pytest

from mlx_redis_gateway.fleet_status import read_fleet_status
from mlx_redis_gateway.status_page import render_fragment
from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent
from mlx_redis_worker.local_redis.server import free_port
from tests.support.processes import MODEL, WorkerFactory, mlx_worker
from tests.support.waiting import run, until

JOBS = {"team-a": 4, "team-b": 1}


def models_json(redis_url: str, prefix: str) -> dict[str, Any]:
    text = mlx_worker("models", "--json", "--redis-url", redis_url, "--prefix", prefix).stdout
    rows = [json.loads(line) for line in text.splitlines()]
    (row,) = [r for r in rows if r.get("model") == MODEL]
    return row


def metric_lines(port: int) -> list[str]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    return [line for line in body.decode().splitlines() if line.startswith("mlxw_tenant_")]


@pytest.mark.timeout(300)
def test_tenants_queued_running_and_served_are_shown_everywhere(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    port = free_port()
    workers.start(
        "w1",
        max_concurrency=1,
        env={"MLXW_FAIR_SHARE": "1", "MLXW_METRICS_PORT": str(port)},
    )

    async def scenario() -> dict[str, int]:
        async with Client(redis_url, prefix=prefix) as client:
            ids = {
                tenant: [
                    await client.submit(f"{tenant} job {i}", max_tokens=24, tenant=tenant)
                    for i in range(count)
                ]
                for tenant, count in JOBS.items()
            }

            async def queued_and_running() -> bool:
                (reply,) = await client.stats()
                shares = {s["tenant"]: s for s in reply.result.get("tenants") or []}
                waiting = sum(s["queued"] for s in shares.values())
                return waiting > 0 and sum(s["running"] for s in shares.values()) == 1

            # One slot: while the first job runs, the others wait in the fair queues.
            await until(queued_and_running, 60, "stats showing queued and running tenants")
            row = await asyncio.to_thread(models_json, redis_url, prefix)
            assert {t["tenant"] for t in row["tenants"]} <= set(JOBS)
            assert sum(t["queued"] for t in row["tenants"]) > 0
            page = render_fragment(await read_fleet_status(client.redis, client.keys))
            assert 'class="tenant"' in page and "team-a" in page

            served: dict[str, int] = {}
            for tenant, rids in ids.items():
                for rid in rids:
                    end = await client.wait(rid, timeout=120)
                    assert isinstance(end, DoneEvent), end
                    # Service: the prompt tokens computed (not cached) and those generated.
                    usage = end.usage
                    work = usage.prompt_tokens - usage.cached_tokens + usage.completion_tokens
                    served[tenant] = served.get(tenant, 0) + work
            return served

    served = run(scenario())

    async def settled() -> Any:
        # Tokens settle with the worker's next pick (it polls while idle).
        row = await asyncio.to_thread(models_json, redis_url, prefix)
        shown = {t["tenant"]: t["served_tokens"] for t in row["tenants"]}
        return shown == served and all(t["queued"] == 0 for t in row["tenants"])

    run(until(settled, 30, f"models showing served tokens {served}"))
    stats = mlx_worker("ctl", "stats", "--redis-url", redis_url, "--prefix", prefix).stdout
    assert f"team-a 0 queued, 0 running, {served['team-a']} tokens" in stats, stats

    async def in_metrics() -> bool:
        lines = await asyncio.to_thread(metric_lines, port)
        wanted = f'mlxw_tenant_served_tokens{{model="{MODEL}",tenant="team-b"}} '
        return any(
            line.startswith(wanted) and line.endswith(f" {served['team-b']}.0") for line in lines
        )

    run(until(in_metrics, 30, "per-tenant series in the metrics"))
