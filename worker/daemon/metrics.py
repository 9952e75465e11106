"""Prometheus metrics of one worker, served on 127.0.0.1 (``--metrics-port``).

Most values already exist as counters inside the engine, the job runner, the publisher and the
consumer group; rather than count everything twice, a periodic ``refresh`` on the event loop
copies them into an immutable snapshot and a custom collector renders that snapshot on each
scrape. Scrapes run on the HTTP server's thread: reading one reference keeps them off the event
loop and off the engine's data structures, and keeps the group query (a Redis round trip) out of
the scrape. The latency histograms are the exception: they need every observation, so the
publisher's ``on_done`` hook feeds them as each request finishes.

The registry is private (not prometheus-client's global one), so a process can hold several
workers, as the tests do.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from threading import Thread
from typing import Any
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol.messages import Usage
from worker.daemon.job_queue import JobQueue
from worker.daemon.jobs import JobRunner
from worker.daemon.publisher import EventPublisher
from worker.daemon.redis_retry import REDIS_FAILURES, describe
from worker.engine import EngineCore

log = structlog.get_logger(__name__)

METRICS_ADDRESS = "127.0.0.1"  # metrics reveal load and job counts: never on a public interface

# Time to first token: tens of milliseconds for a cached prefix up to seconds for a long
# prefill behind a full batch.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Whole jobs: a few tokens up to several minutes of generation.
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the collector renders, taken at one moment on the event loop."""

    in_flight: int = 0
    outcomes: Mapping[str, int] = field(default_factory=dict)
    tokens_generated: int = 0
    engine_steps: int = 0
    engine_thread_cpu_seconds: float = 0.0
    engine_step_seconds: float = 0.0
    engine_model_seconds: float = 0.0
    redis_round_trips: int = 0
    # None when Redis could not be asked (down) or did not know (``lag`` can be NULL).
    group_lag: int | None = None
    group_pending: int | None = None
    # None when the engine runs without a prefix cache.
    prefix_cache_hit_rate: float | None = None
    taken_at: float = 0.0


@dataclass(frozen=True, slots=True)
class MetricSources:
    """Where a refresh reads its figures: the worker's own counters, not copies of them."""

    engine: EngineCore
    runner: JobRunner
    publisher: EventPublisher
    queue: JobQueue


class Metrics:
    def __init__(self, port: int) -> None:
        self.port = port
        self.registry = CollectorRegistry()
        self.collector = SnapshotCollector()
        self.registry.register(self.collector)
        self.ttft = Histogram(
            "mlxw_ttft_seconds",
            "Time from a job's arrival in the queue (its entry id) to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "mlxw_job_duration_seconds",
            "Time from a job's arrival in the queue to its end, for jobs that generated.",
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self._server: WSGIServer | None = None
        self._thread: Thread | None = None

    def start(self) -> None:
        """Serve ``/metrics`` on ``127.0.0.1:port`` from a daemon thread."""
        self._server, self._thread = start_http_server(
            self.port, addr=METRICS_ADDRESS, registry=self.registry
        )
        log.info("metrics_serving", address=f"http://{METRICS_ADDRESS}:{self.port}/metrics")

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def observe_done(self, request_id: str, usage: Usage) -> None:
        """``EventPublisher.on_done`` hook. Jobs that never reached the engine (expired,
        aborted while queued) have no first token; their near-zero durations would only
        blur the histogram of real generations, so they are left out."""
        if usage.ttft_ms is None:
            return
        self.ttft.observe(usage.ttft_ms / 1000)
        self.duration.observe(usage.duration_ms / 1000)

    async def refresh(self, sources: MetricSources) -> None:
        """Take a new snapshot (event loop; called periodically by the worker)."""
        lag = pending = None
        try:
            group = await sources.queue.group_info()
            lag, pending = _int_or_none(group.get("lag")), _int_or_none(group.get("pending"))
        except REDIS_FAILURES as exc:
            # The other counters matter most exactly when Redis is down: publish them anyway.
            log.debug("metrics_group_info_failed", error=describe(exc))
        engine = sources.engine.stats()
        cache = sources.engine.cache_stats()
        self.collector.snapshot = Snapshot(
            in_flight=len(sources.runner.in_flight),
            outcomes=dict(sources.runner.outcomes),
            tokens_generated=engine.scheduler.total_completion_tokens,
            engine_steps=engine.steps_executed,
            engine_thread_cpu_seconds=engine.engine_thread_cpu_seconds,
            engine_step_seconds=engine.step_seconds,
            engine_model_seconds=engine.scheduler.model_seconds,
            redis_round_trips=sources.publisher.round_trips,
            group_lag=lag,
            group_pending=pending,
            prefix_cache_hit_rate=cache.hit_rate if cache is not None else None,
            taken_at=time.time(),
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


def _families(snapshot: Snapshot) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "mlxw_requests_in_flight", "Jobs running in the engine.", value=snapshot.in_flight
    )
    jobs = CounterMetricFamily(
        "mlxw_jobs", "Jobs handled, by outcome (completed, expired, ...).", labels=["outcome"]
    )
    for outcome, count in sorted(snapshot.outcomes.items()):
        jobs.add_metric([outcome], count)
    yield jobs
    yield CounterMetricFamily(
        "mlxw_tokens_generated", "Tokens generated by the engine.", value=snapshot.tokens_generated
    )
    yield CounterMetricFamily(
        "mlxw_engine_steps",
        "Engine steps (one batched decode or prefill each).",
        value=snapshot.engine_steps,
    )
    yield CounterMetricFamily(
        "mlxw_engine_thread_cpu_seconds",
        "CPU time of the engine thread; near 1 s per second means serving is host-bound.",
        value=snapshot.engine_thread_cpu_seconds,
    )
    yield CounterMetricFamily(
        "mlxw_engine_step_seconds",
        "Wall time of engine steps.",
        value=snapshot.engine_step_seconds,
    )
    yield CounterMetricFamily(
        "mlxw_engine_model_seconds",
        "Of the engine step time, the part inside mlx-lm's BatchGenerator (model, sampling,"
        " device wait); the rest is the engine's own host work.",
        value=snapshot.engine_model_seconds,
    )
    yield CounterMetricFamily(
        "mlxw_redis_round_trips",
        "Pipelines the event publisher sent to Redis (one per engine step at most).",
        value=snapshot.redis_round_trips,
    )
    yield _optional_gauge(
        "mlxw_group_lag", "Job entries not yet delivered to the group.", snapshot.group_lag
    )
    yield _optional_gauge(
        "mlxw_group_pending",
        "Job entries delivered to the group's workers and not yet acknowledged.",
        snapshot.group_pending,
    )
    yield _optional_gauge(
        "mlxw_prefix_cache_hit_rate",
        "Share of prefix-cache lookups that found a cached prefix.",
        snapshot.prefix_cache_hit_rate,
    )
    yield GaugeMetricFamily(
        "mlxw_metrics_refreshed_timestamp_seconds",
        "When these values were taken; stalls when the worker's event loop does.",
        value=snapshot.taken_at,
    )


def _optional_gauge(name: str, documentation: str, value: float | None) -> GaugeMetricFamily:
    """A gauge with no sample when the value is unknown: a gap, rather than a false zero."""
    gauge = GaugeMetricFamily(name, documentation)
    if value is not None:
        gauge.add_metric([], value)
    return gauge


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None
