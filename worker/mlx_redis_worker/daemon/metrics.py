"""Prometheus metrics of one worker, served on 127.0.0.1 (``--metrics-port``).

Most values already exist as counters inside the engine, the job runner, the publisher and the
consumer group; rather than count everything twice, a periodic ``refresh`` on the event loop
copies them into an immutable snapshot and a custom collector renders that snapshot on each
scrape. Scrapes run on the HTTP server's thread: reading one reference keeps them off the event
loop and off the engine's data structures, and keeps the group query (a Redis round trip) out of
the scrape. The latency histograms are the exception: they need every observation, so the
publisher's ``on_done`` hook feeds them as each request finishes.

Series of one model's engine, jobs and stream carry a ``model`` label: a worker may serve
several models, and a fleet's dashboards and autoscalers look at each model's queue. The
speculative decoding series carry a ``method`` label too (``prompt_lookup``, ``draft_model``):
the two methods pay off on different requests, and one total would hide which one does.

The registry is private (not prometheus-client's global one), so a process can hold several
workers, as the tests do.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from threading import Thread
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mlx_redis_protocol.heap import CollectionPauses, GenerationPauses
from mlx_redis_protocol.messages import Usage
from mlx_redis_protocol.redis_retry import REDIS_FAILURES, describe
from mlx_redis_worker.daemon.fair_queue import FairQueue
from mlx_redis_worker.daemon.job_queue import JobQueue
from mlx_redis_worker.daemon.jobs import JobRunner
from mlx_redis_worker.daemon.publisher import EventPublisher
from mlx_redis_worker.engine.stats import MethodStats

if TYPE_CHECKING:
    from mlx_redis_worker.engine import AnyEngine

log = structlog.get_logger(__name__)

METRICS_ADDRESS = "127.0.0.1"  # metrics reveal load and job counts: never on a public interface

# Time to first token: tens of milliseconds for a cached prefix up to seconds for a long
# prefill behind a full batch.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Whole jobs: a few tokens up to several minutes of generation.
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True, slots=True)
class ModelSnapshot:
    """One model's figures (each series carries its ``model`` label)."""

    model: str
    in_flight: int = 0
    outcomes: Mapping[str, int] = field(default_factory=dict)
    tokens_generated: int = 0
    engine_steps: int = 0
    engine_thread_cpu_seconds: float = 0.0
    engine_step_seconds: float = 0.0
    engine_model_seconds: float = 0.0
    # None when Redis could not be asked (down) or did not know (``lag`` can be NULL).
    group_lag: int | None = None
    group_pending: int | None = None
    # None when the engine runs without a prefix cache.
    prefix_cache_hit_rate: float | None = None
    # With fair share on: per tenant, (waiting, running here, tokens served in 10 minutes).
    tenants: Mapping[str, tuple[int, int, int]] = field(default_factory=dict)
    # Per speculative method (SpeculativeParams.method): its rows' figures in the engine.
    speculation: Mapping[str, MethodStats] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the collector renders, taken at one moment on the event loop."""

    models: tuple[ModelSnapshot, ...] = ()
    redis_round_trips: int = 0
    taken_at: float = 0.0
    # The process's garbage collections by generation (each a pause of every thread).
    collections: tuple[GenerationPauses, ...] = ()


@dataclass(frozen=True, slots=True)
class MetricSources:
    """Where a refresh reads one model's figures: the worker's own counters, not copies."""

    model: str
    engine: AnyEngine
    runner: JobRunner
    queue: JobQueue
    fair: FairQueue | None = None


class Metrics:
    def __init__(self, port: int) -> None:
        self.port = port
        self.registry = CollectorRegistry()
        self.collector = SnapshotCollector()
        self.registry.register(self.collector)
        self.ttft = Histogram(
            "mlxw_ttft_seconds",
            "Time from a job's arrival in the queue (its entry id) to its first generated token.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "mlxw_job_duration_seconds",
            "Time from a job's arrival in the queue to its end, for jobs that generated.",
            ["model"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self._server: WSGIServer | None = None
        self._thread: Thread | None = None
        self.collections = CollectionPauses()

    def start(self) -> None:
        """Serve ``/metrics`` on ``127.0.0.1:port`` from a daemon thread, and time the
        process's garbage collections from now on."""
        self.collections.install()
        self._server, self._thread = start_http_server(
            self.port, addr=METRICS_ADDRESS, registry=self.registry
        )
        log.info("metrics_serving", address=f"http://{METRICS_ADDRESS}:{self.port}/metrics")

    def close(self) -> None:
        self.collections.remove()
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def observe_done(self, model: str | None, usage: Usage) -> None:
        """``EventPublisher.on_done`` hook. Jobs that never reached the engine (expired,
        aborted while queued) have no first token; their near-zero durations would only
        blur the histogram of real generations, so they are left out."""
        if usage.ttft_ms is None:
            return
        label = model or ""
        self.ttft.labels(model=label).observe(usage.ttft_ms / 1000)
        self.duration.labels(model=label).observe(usage.duration_ms / 1000)

    async def refresh(self, sources: list[MetricSources], publisher: EventPublisher) -> None:
        """Take a new snapshot (event loop; called periodically by the worker)."""
        self.collector.snapshot = Snapshot(
            models=tuple([await _model_snapshot(source) for source in sources]),
            redis_round_trips=publisher.round_trips,
            taken_at=time.time(),
            collections=self.collections.totals(),
        )


async def _model_snapshot(source: MetricSources) -> ModelSnapshot:
    lag = pending = None
    try:
        group = await source.queue.group_info()
        lag, pending = _int_or_none(group.get("lag")), _int_or_none(group.get("pending"))
    except REDIS_FAILURES as exc:
        # The other counters matter most exactly when Redis is down: publish them anyway.
        log.debug("metrics_group_info_failed", error=describe(exc))
    tenants: dict[str, tuple[int, int, int]] = {}
    if source.fair is not None:
        try:
            for share in await source.fair.shares():
                tenants[share["tenant"]] = (
                    share["queued"],
                    share["running"],
                    share["served_tokens"],
                )
        except REDIS_FAILURES as exc:
            log.debug("metrics_tenant_shares_failed", error=describe(exc))
    engine = source.engine.stats()
    cache = source.engine.cache_stats()
    return ModelSnapshot(
        model=source.model,
        in_flight=len(source.runner.in_flight),
        outcomes=dict(source.runner.outcomes),
        tokens_generated=engine.scheduler.total_completion_tokens,
        engine_steps=engine.steps_executed,
        engine_thread_cpu_seconds=engine.engine_thread_cpu_seconds,
        engine_step_seconds=engine.step_seconds,
        engine_model_seconds=engine.scheduler.model_seconds,
        group_lag=lag,
        group_pending=pending,
        prefix_cache_hit_rate=cache.hit_rate if cache is not None else None,
        tenants=tenants,
        speculation=engine.scheduler.speculation.methods(),
    )


class SnapshotCollector(Collector):
    """Renders the latest ``Snapshot``; the worker replaces it, scrapes only read it."""

    def __init__(self) -> None:
        self.snapshot = Snapshot()

    def describe(self) -> Iterator[Metric]:
        # The names are fixed, so an empty snapshot describes them all.
        return _families(Snapshot())

    def collect(self) -> Iterator[Metric]:
        return _families(self.snapshot)


# Per-model series: (name, kind, help, the ModelSnapshot field).
_MODEL_SERIES: tuple[
    tuple[str, type[GaugeMetricFamily] | type[CounterMetricFamily], str, str], ...
] = (
    ("mlxw_requests_in_flight", GaugeMetricFamily, "Jobs running in the engine.", "in_flight"),
    (
        "mlxw_tokens_generated",
        CounterMetricFamily,
        "Tokens generated by the engine.",
        "tokens_generated",
    ),
    (
        "mlxw_engine_steps",
        CounterMetricFamily,
        "Engine steps (one batched decode or prefill each).",
        "engine_steps",
    ),
    (
        "mlxw_engine_thread_cpu_seconds",
        CounterMetricFamily,
        "CPU time of the engine thread; near 1 s per second means serving is host-bound.",
        "engine_thread_cpu_seconds",
    ),
    (
        "mlxw_engine_step_seconds",
        CounterMetricFamily,
        "Wall time of engine steps.",
        "engine_step_seconds",
    ),
    (
        "mlxw_engine_model_seconds",
        CounterMetricFamily,
        "Of the engine step time, the part inside mlx-lm's BatchGenerator (model, sampling,"
        " device wait); the rest is the engine's own host work.",
        "engine_model_seconds",
    ),
    (
        "mlxw_group_lag",
        GaugeMetricFamily,
        "Job entries of the model's stream not yet delivered to the group (an autoscaling signal).",
        "group_lag",
    ),
    (
        "mlxw_group_pending",
        GaugeMetricFamily,
        "Job entries of the model's stream delivered to the group's workers and not yet"
        " acknowledged.",
        "group_pending",
    ),
    (
        "mlxw_prefix_cache_hit_rate",
        GaugeMetricFamily,
        "Share of prefix-cache lookups that found a cached prefix.",
        "prefix_cache_hit_rate",
    ),
)


# Per-method speculative series: (name, kind, help, the MethodStats field, whether the value
# means anything before one of the method's rows was verified).
_SPECULATIVE_SERIES: tuple[
    tuple[str, type[GaugeMetricFamily] | type[CounterMetricFamily], str, str, bool], ...
] = (
    (
        "mlxw_speculative_steps",
        CounterMetricFamily,
        "Speculative verify steps (one forward pass checking the batch's drafts) in which a"
        " row of the method drafted; a step with rows of both methods counts for each.",
        "steps",
        True,
    ),
    (
        "mlxw_speculative_rows",
        CounterMetricFamily,
        "Sequence rows of the method that drafted in a verify step.",
        "rows",
        True,
    ),
    (
        "mlxw_speculative_draft_tokens",
        CounterMetricFamily,
        "Draft tokens of the method that the model verified.",
        "draft_tokens",
        True,
    ),
    (
        "mlxw_speculative_accepted_tokens",
        CounterMetricFamily,
        "Draft tokens of the method that the model accepted (each one a token gained without"
        " a step of its own).",
        "accepted_tokens",
        True,
    ),
    (
        "mlxw_speculative_acceptance_rate",
        GaugeMetricFamily,
        "Accepted / verified draft tokens of the method since the worker started.",
        "acceptance_rate",
        False,
    ),
    (
        "mlxw_speculative_tokens_per_step",
        GaugeMetricFamily,
        "Tokens a sequence drafting with the method got per verify step (1 + its accepted"
        " drafts, on average).",
        "tokens_per_step",
        False,
    ),
)


def _families(snapshot: Snapshot) -> Iterator[Metric]:
    for name, kind, documentation, attribute in _MODEL_SERIES:
        family = kind(name, documentation, labels=["model"])
        for model in snapshot.models:
            value = getattr(model, attribute)
            if value is not None:  # unknown: a gap, rather than a false zero
                family.add_metric([model.model], value)
        yield family
    jobs = CounterMetricFamily(
        "mlxw_jobs",
        "Jobs handled, by model and outcome (completed, expired, ...).",
        labels=["model", "outcome"],
    )
    for model in snapshot.models:
        for outcome, count in sorted(model.outcomes.items()):
            jobs.add_metric([model.model, outcome], count)
    yield jobs
    yield from _speculative_families(snapshot)
    yield from _tenant_families(snapshot)
    yield from _collection_families(snapshot)
    yield CounterMetricFamily(
        "mlxw_redis_round_trips",
        "Pipelines the event publisher sent to Redis (one per engine step at most).",
        value=snapshot.redis_round_trips,
    )
    yield GaugeMetricFamily(
        "mlxw_metrics_refreshed_timestamp_seconds",
        "When these values were taken; stalls when the worker's event loop does.",
        value=snapshot.taken_at,
    )


def _speculative_families(snapshot: Snapshot) -> Iterator[Metric]:
    for name, kind, documentation, attribute, from_start in _SPECULATIVE_SERIES:
        family = kind(name, documentation, labels=["model", "method"])
        for model in snapshot.models:
            for method, stats in model.speculation.items():
                # A rate before any verified row would be a false zero: a gap instead.
                if from_start or stats.rows > 0:
                    family.add_metric([model.model, method], getattr(stats, attribute))
        yield family


# Per-tenant series (fair share on): (name, help, index in ModelSnapshot.tenants' tuples).
_TENANT_SERIES = (
    ("mlxw_tenant_queued", "Jobs of the tenant waiting for a fair pick (fleet-wide).", 0),
    ("mlxw_tenant_running", "Jobs of the tenant running on this worker.", 1),
    (
        "mlxw_tenant_served_tokens",
        "Tokens generated for the tenant over the last 10 minutes (fleet-wide).",
        2,
    ),
)


def _tenant_families(snapshot: Snapshot) -> Iterator[Metric]:
    for name, documentation, index in _TENANT_SERIES:
        family = GaugeMetricFamily(name, documentation, labels=["model", "tenant"])
        for model in snapshot.models:
            for tenant, figures in sorted(model.tenants.items()):
                family.add_metric([model.model, tenant], figures[index])
        yield family


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def _collection_families(snapshot: Snapshot) -> Iterator[Metric]:
    collections = CounterMetricFamily(
        "mlxw_gc_collections",
        "The process's garbage collections by generation (2: full).",
        labels=["generation"],
    )
    pauses = CounterMetricFamily(
        "mlxw_gc_pause_seconds",
        "Seconds spent in them: each holds the GIL, so every stream waits.",
        labels=["generation"],
    )
    longest = GaugeMetricFamily(
        "mlxw_gc_pause_longest_seconds",
        "The longest one since the worker started.",
        labels=["generation"],
    )
    for pause in snapshot.collections:
        generation = [str(pause.generation)]
        collections.add_metric(generation, pause.collections)
        pauses.add_metric(generation, pause.seconds)
        longest.add_metric(generation, pause.longest)
    yield collections
    yield pauses
    yield longest
