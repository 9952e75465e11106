"""The metrics module on its own: snapshot rendering and the done-event hook."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import ConnectionError as RedisConnectionError

from mlx_redis_protocol.messages import Usage
from mlx_redis_worker.daemon.metrics import Metrics, MetricSources
from mlx_redis_worker.engine.speculative_batch import SpeculationCounters
from mlx_redis_worker.engine.stats import SpeculationStats


class FakeEngine:
    """The engine's typed stats, the only part of it the metrics read."""

    def __init__(self, hit_rate: float | None, speculated: bool = True) -> None:
        self.hit_rate = hit_rate
        self.speculation = (
            SpeculationCounters(steps=10, rows=12, drafted=40, accepted=30, emitted=50)
            if speculated
            else SpeculationCounters()
        )

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(
            steps_executed=42,
            engine_thread_cpu_seconds=1.5,
            step_seconds=2.0,
            scheduler=SimpleNamespace(
                total_completion_tokens=300,
                model_seconds=1.75,
                speculation=SpeculationStats.of(self.speculation),
            ),
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

    def __init__(self, sources: list[MetricSources]) -> None:
        super().__init__(0)
        self.sources = sources
        self.publisher = SimpleNamespace(round_trips=17)

    async def refresh_now(self) -> None:
        await self.refresh(self.sources, self.publisher)  # type: ignore[arg-type]


def source(model: str, group: dict[str, Any] | None, hit_rate: float | None) -> MetricSources:
    runner = SimpleNamespace(in_flight={"r1": "1-0", "r2": "2-0"}, outcomes={"completed": 5})
    return MetricSources(
        model=model,
        # A model without a prefix cache has not speculated either: its rates are gaps.
        engine=FakeEngine(hit_rate, speculated=hit_rate is not None),  # type: ignore[arg-type]
        runner=runner,  # type: ignore[arg-type]
        queue=FakeQueue(group),  # type: ignore[arg-type]
    )


def metrics(group: dict[str, Any] | None, hit_rate: float | None) -> Sourced:
    return Sourced([source("tiny", group, hit_rate)])


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
    # Nothing before the first refresh (no model known yet: no per-model sample at all).
    assert samples(m).get("mlxw_requests_in_flight{model=tiny}", 0) == 0
    asyncio.run(m.refresh_now())
    found = samples(m)
    assert found["mlxw_requests_in_flight{model=tiny}"] == 2
    assert found["mlxw_jobs_total{model=tiny,outcome=completed}"] == 5
    assert found["mlxw_tokens_generated_total{model=tiny}"] == 300
    assert found["mlxw_engine_steps_total{model=tiny}"] == 42
    assert found["mlxw_engine_thread_cpu_seconds_total{model=tiny}"] == 1.5
    assert found["mlxw_engine_step_seconds_total{model=tiny}"] == 2.0
    assert found["mlxw_engine_model_seconds_total{model=tiny}"] == 1.75
    assert found["mlxw_redis_round_trips_total"] == 17
    assert found["mlxw_group_lag{model=tiny}"] == 3
    assert found["mlxw_group_pending{model=tiny}"] == 2
    assert found["mlxw_prefix_cache_hit_rate{model=tiny}"] == 0.25
    assert found["mlxw_speculative_steps_total{model=tiny}"] == 10
    assert found["mlxw_speculative_draft_tokens_total{model=tiny}"] == 40
    assert found["mlxw_speculative_accepted_tokens_total{model=tiny}"] == 30
    assert found["mlxw_speculative_acceptance_rate{model=tiny}"] == 0.75
    assert found["mlxw_speculative_tokens_per_step{model=tiny}"] == 3.5
    assert found["mlxw_metrics_refreshed_timestamp_seconds"] > 0


def test_each_model_has_its_own_series() -> None:
    """Two models: one labelled sample per model; a gap in one model's figures (its group
    unknown, no prefix cache) leaves the other's samples in place."""
    m = Sourced([source("tiny", {"lag": 3, "pending": 2}, 0.25), source("small", None, None)])
    asyncio.run(m.refresh_now())
    found = samples(m)
    assert found["mlxw_requests_in_flight{model=tiny}"] == 2
    assert found["mlxw_requests_in_flight{model=small}"] == 2
    assert found["mlxw_jobs_total{model=small,outcome=completed}"] == 5
    assert found["mlxw_group_lag{model=tiny}"] == 3
    assert "mlxw_group_lag{model=small}" not in found
    assert "mlxw_group_pending{model=small}" not in found
    assert found["mlxw_prefix_cache_hit_rate{model=tiny}"] == 0.25
    assert "mlxw_prefix_cache_hit_rate{model=small}" not in found


def test_unknown_values_are_gaps_not_zeros() -> None:
    """Redis down (no lag/pending) and no prefix cache: those series vanish, the rest stays."""
    m = metrics(None, None)
    asyncio.run(m.refresh_now())
    found = samples(m)
    assert "mlxw_group_lag{model=tiny}" not in found
    assert "mlxw_group_pending{model=tiny}" not in found
    assert "mlxw_prefix_cache_hit_rate{model=tiny}" not in found
    assert "mlxw_speculative_acceptance_rate{model=tiny}" not in found
    assert found["mlxw_speculative_steps_total{model=tiny}"] == 0
    assert found["mlxw_requests_in_flight{model=tiny}"] == 2
    m = metrics({"lag": None, "pending": 0}, None)  # Redis may not know the lag
    asyncio.run(m.refresh_now())
    assert "mlxw_group_lag{model=tiny}" not in samples(m)
    assert samples(m)["mlxw_group_pending{model=tiny}"] == 0


def test_done_hook_feeds_the_histograms() -> None:
    m = metrics({}, None)
    m.observe_done(
        "tiny", Usage(prompt_tokens=3, completion_tokens=8, ttft_ms=40.0, duration_ms=900.0)
    )
    # Never reached the engine (expired, aborted while queued): not a generation.
    m.observe_done("tiny", Usage(prompt_tokens=0, completion_tokens=0, duration_ms=1.0))
    found = samples(m)
    assert found["mlxw_ttft_seconds_count{model=tiny}"] == 1
    assert found["mlxw_ttft_seconds_sum{model=tiny}"] == 0.04
    assert found["mlxw_ttft_seconds_bucket{le=0.05,model=tiny}"] == 1
    assert found["mlxw_job_duration_seconds_count{model=tiny}"] == 1
    assert found["mlxw_job_duration_seconds_sum{model=tiny}"] == 0.9


def test_done_hook_labels_each_model() -> None:
    m = metrics({}, None)
    m.observe_done("tiny", Usage(prompt_tokens=3, completion_tokens=8, ttft_ms=40.0))
    m.observe_done("small", Usage(prompt_tokens=3, completion_tokens=8, ttft_ms=400.0))
    m.observe_done("small", Usage(prompt_tokens=3, completion_tokens=8, ttft_ms=20.0))
    found = samples(m)
    assert found["mlxw_ttft_seconds_count{model=tiny}"] == 1
    assert found["mlxw_ttft_seconds_count{model=small}"] == 2


def test_registries_are_independent() -> None:
    first, second = metrics({}, None), metrics({}, None)
    first.observe_done("tiny", Usage(prompt_tokens=1, completion_tokens=1, ttft_ms=1.0))
    assert samples(first)["mlxw_ttft_seconds_count{model=tiny}"] == 1
    # (A labelled histogram shows no sample until its label is first observed.)
    assert samples(second).get("mlxw_ttft_seconds_count{model=tiny}", 0) == 0
