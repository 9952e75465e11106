"""The metrics module on its own: snapshot rendering and the done-event hook."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import ConnectionError as RedisConnectionError

from protocol.messages import Usage
from worker.daemon.metrics import Metrics, MetricSources


class FakeEngine:
    """The engine's typed stats, the only part of it the metrics read."""

    def __init__(self, hit_rate: float | None) -> None:
        self.hit_rate = hit_rate

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(
            steps_executed=42,
            engine_thread_cpu_seconds=1.5,
            step_seconds=2.0,
            scheduler=SimpleNamespace(total_completion_tokens=300, model_seconds=1.75),
        )

    def cache_stats(self) -> SimpleNamespace | None:
        return None if self.hit_rate is None else SimpleNamespace(hit_rate=self.hit_rate)


class FakeQueue:
    def __init__(self, group: dict[str, Any] | None) -> None:
        self.group = group

    async def group_info(self) -> dict[str, Any]:
        if self.group is None:
            raise RedisConnectionError("down")
        return self.group


class Sourced(Metrics):
    """Metrics with the fake sources a refresh reads."""

    def __init__(self, sources: MetricSources) -> None:
        super().__init__(0)
        self.sources = sources

    async def refresh_now(self) -> None:
        await self.refresh(self.sources)


def metrics(group: dict[str, Any] | None, hit_rate: float | None) -> Sourced:
    runner = SimpleNamespace(in_flight={"r1": "1-0", "r2": "2-0"}, outcomes={"completed": 5})
    publisher = SimpleNamespace(round_trips=17)
    sources = MetricSources(
        engine=FakeEngine(hit_rate),  # type: ignore[arg-type]
        runner=runner,  # type: ignore[arg-type]
        publisher=publisher,  # type: ignore[arg-type]
        queue=FakeQueue(group),  # type: ignore[arg-type]
    )
    return Sourced(sources)


def samples(m: Metrics) -> dict[str, float]:
    text = generate_latest(m.registry).decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return found


def test_refresh_copies_the_sources() -> None:
    m = metrics({"name": "g", "lag": 3, "pending": 2}, 0.25)
    assert samples(m)["mlxw_requests_in_flight"] == 0  # nothing before the first refresh
    asyncio.run(m.refresh_now())
    found = samples(m)
    assert found["mlxw_requests_in_flight"] == 2
    assert found["mlxw_jobs_total{outcome=completed}"] == 5
    assert found["mlxw_tokens_generated_total"] == 300
    assert found["mlxw_engine_steps_total"] == 42
    assert found["mlxw_engine_thread_cpu_seconds_total"] == 1.5
    assert found["mlxw_engine_step_seconds_total"] == 2.0
    assert found["mlxw_engine_model_seconds_total"] == 1.75
    assert found["mlxw_redis_round_trips_total"] == 17
    assert found["mlxw_group_lag"] == 3
    assert found["mlxw_group_pending"] == 2
    assert found["mlxw_prefix_cache_hit_rate"] == 0.25
    assert found["mlxw_metrics_refreshed_timestamp_seconds"] > 0


def test_unknown_values_are_gaps_not_zeros() -> None:
    """Redis down (no lag/pending) and no prefix cache: those series vanish, the rest stays."""
    m = metrics(None, None)
    asyncio.run(m.refresh_now())
    found = samples(m)
    assert "mlxw_group_lag" not in found
    assert "mlxw_group_pending" not in found
    assert "mlxw_prefix_cache_hit_rate" not in found
    assert found["mlxw_requests_in_flight"] == 2
    m = metrics({"lag": None, "pending": 0}, None)  # Redis may not know the lag
    asyncio.run(m.refresh_now())
    assert "mlxw_group_lag" not in samples(m)
    assert samples(m)["mlxw_group_pending"] == 0


def test_done_hook_feeds_the_histograms() -> None:
    m = metrics({}, None)
    m.observe_done(
        "r1", Usage(prompt_tokens=3, completion_tokens=8, ttft_ms=40.0, duration_ms=900.0)
    )
    # Never reached the engine (expired, aborted while queued): not a generation.
    m.observe_done("r2", Usage(prompt_tokens=0, completion_tokens=0, duration_ms=1.0))
    found = samples(m)
    assert found["mlxw_ttft_seconds_count"] == 1
    assert found["mlxw_ttft_seconds_sum"] == 0.04
    assert found["mlxw_ttft_seconds_bucket{le=0.05}"] == 1
    assert found["mlxw_job_duration_seconds_count"] == 1
    assert found["mlxw_job_duration_seconds_sum"] == 0.9


def test_registries_are_independent() -> None:
    first, second = metrics({}, None), metrics({}, None)
    first.observe_done("r", Usage(prompt_tokens=1, completion_tokens=1, ttft_ms=1.0))
    assert samples(second)["mlxw_ttft_seconds_count"] == 0
