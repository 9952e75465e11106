"""The metrics module on its own: snapshot rendering and the done-event hook, from fake
sources and, for the speculative series, from a real engine's run."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
from types import SimpleNamespace
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import ConnectionError as RedisConnectionError

from mlx_redis_protocol.messages import Usage
from mlx_redis_worker.daemon.metrics import Metrics, MetricSources
from mlx_redis_worker.engine import EngineCore, SamplingParams, SpeculativeParams
from mlx_redis_worker.engine.config import DraftModel
from mlx_redis_worker.engine.speculative_batch import SpeculationCounters
from mlx_redis_worker.engine.stats import SpeculationStats
from tests.support.engines import REPEATING, collect, make_engine
from tests.support.waiting import run


class FakeEngine:
    """The engine's typed stats, the only part of it the metrics read."""

    def __init__(self, hit_rate: float | None, speculated: bool = True) -> None:
        self.hit_rate = hit_rate
        self.speculation = (
            # 10 verify steps: 9 with prompt-lookup rows, 2 with draft-model rows (1 with both).
            SpeculationCounters(
                steps=10,
                rows=12,
                drafted=40,
                accepted=30,
                emitted=50,
                model_rows=2,
                model_drafted=8,
                model_accepted=2,
                lookup_steps=9,
                model_steps=2,
            )
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


# The speculative series, by the MethodStats field each one renders.
SPECULATIVE_SERIES = {
    "steps": "mlxw_speculative_steps_total",
    "rows": "mlxw_speculative_rows_total",
    "draft_tokens": "mlxw_speculative_draft_tokens_total",
    "accepted_tokens": "mlxw_speculative_accepted_tokens_total",
    "acceptance_rate": "mlxw_speculative_acceptance_rate",
    "tokens_per_step": "mlxw_speculative_tokens_per_step",
}


def speculative(found: dict[str, float], method: str) -> dict[str, float]:
    """The samples of one method's speculative series (model ``tiny``) that are there."""
    labels = f"method={method},model=tiny"
    return {
        field: found[f"{name}{{{labels}}}"]
        for field, name in SPECULATIVE_SERIES.items()
        if f"{name}{{{labels}}}" in found
    }


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
    assert speculative(found, "prompt_lookup") == {
        "steps": 9,
        "rows": 10,
        "draft_tokens": 32,
        "accepted_tokens": 28,
        "acceptance_rate": 0.875,
        "tokens_per_step": 3.8,
    }
    assert speculative(found, "draft_model") == {
        "steps": 2,
        "rows": 2,
        "draft_tokens": 8,
        "accepted_tokens": 2,
        "acceptance_rate": 0.25,
        "tokens_per_step": 2.0,
    }
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
    # No row verified yet: the counters are zeros, the rates gaps.
    for method in ("prompt_lookup", "draft_model"):
        zeros = {"steps": 0, "rows": 0, "draft_tokens": 0, "accepted_tokens": 0}
        assert speculative(found, method) == zeros
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


def test_the_process_s_garbage_collections_are_timed_while_the_metrics_run() -> None:
    """Each collection holds the GIL (every stream waits): its count, seconds and longest by
    generation, from the collector's own hook, counted between start and close only."""
    m = metrics({}, None)
    gc.collect()  # before start: not counted
    m.collections.install()
    try:
        gc.collect()
        gc.collect()
        during = m.collections.totals()[2].collections
    finally:
        m.collections.remove()
    gc.collect()  # after close: not counted
    asyncio.run(m.refresh_now())
    found = samples(m)
    assert during >= 2  # (the interpreter may add one of its own)
    assert found["mlxw_gc_collections_total{generation=2}"] == during
    assert found["mlxw_gc_pause_seconds_total{generation=2}"] > 0
    longest = found["mlxw_gc_pause_longest_seconds{generation=2}"]
    assert 0 < longest <= found["mlxw_gc_pause_seconds_total{generation=2}"]
    assert {"0", "1", "2"} == {
        name.split("generation=")[1].rstrip("}")
        for name in found
        if name.startswith("mlxw_gc_collections_total")
    }


def test_a_real_engine_run_gives_each_speculative_method_its_series(tiny_model: Any) -> None:
    """The tiny model serving prompt-lookup and draft-model rows in one batch (drafting for
    itself): each method's series are the engine's own figures for that method; the
    draft-model rows, a model drafting for itself, have every draft accepted."""
    requests = [(prompt, "prompt_lookup") for prompt in REPEATING[:2]]
    requests += [(prompt, "draft_model") for prompt in REPEATING[2:]]

    async def serve(engine: EngineCore) -> None:
        ids = [
            await engine.add_request(
                prompt,
                SamplingParams(
                    max_tokens=24,
                    temperature=0.0,
                    speculative=SpeculativeParams(method=method, num_draft_tokens=3),  # type: ignore[arg-type]
                ),
            )
            for prompt, method in requests
        ]
        await asyncio.gather(*(collect(engine, request_id) for request_id in ids))
        await engine.stop()

    with contextlib.closing(
        make_engine(tiny_model, draft=DraftModel("tiny", *tiny_model))
    ) as engine:
        run(serve(engine))
        m = Sourced(
            [
                MetricSources(
                    model="tiny",
                    engine=engine,
                    runner=SimpleNamespace(in_flight={}, outcomes={}),  # type: ignore[arg-type]
                    queue=FakeQueue({}),  # type: ignore[arg-type]
                )
            ]
        )
        asyncio.run(m.refresh_now())
        stats = engine.stats().scheduler.speculation
    found = samples(m)
    for method, figures in stats.methods().items():
        assert figures.rows > 0 and figures.accepted_tokens > 0, (method, figures)
        assert speculative(found, method) == dataclasses.asdict(figures)
    lookup, model = stats.prompt_lookup, stats.draft_model
    assert model.acceptance_rate == 1.0
    # The two methods' rows and drafts add up to the totals; their steps cover every verify
    # step, and a step in which both drafted counts for each.
    assert lookup.rows + model.rows == stats.rows
    assert lookup.draft_tokens + model.draft_tokens == stats.draft_tokens
    assert lookup.accepted_tokens + model.accepted_tokens == stats.accepted_tokens
    assert max(lookup.steps, model.steps) <= stats.steps < lookup.steps + model.steps
