"""The worker as a service manager runs it: a real ``mlx-worker run`` child process.

Under a fake systemd notify socket it reports READY=1, then watchdog pings, then STOPPING=1;
SIGTERM with a job in flight lets the job finish and exits 0 within the drain timeout; the
metrics endpoint serves every named family after a job.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DeltaEvent, DoneEvent, Event
from mlx_redis_worker.local_redis import RedisServer, free_port
from tests.ops.helpers import NotifySocket, scrape, service_worker
from tests.support.processes import MODEL, READY_TIMEOUT
from tests.support.waiting import wait_until


@pytest.mark.timeout(120)
def test_notify_ready_then_watchdog_then_stopping(
    tmp_path: Path, redis_server: RedisServer, prefix: str, tiny: str
) -> None:
    notify = NotifySocket(tmp_path / "notify.sock")
    worker = service_worker(
        tmp_path,
        tiny,
        "notified",
        prefix,
        redis_url=redis_server.url,
        env={"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "1000000"},
    )
    try:
        lines = notify.wait_for("READY=1", READY_TIMEOUT, worker)
        # READY=1 comes first: nothing before start-up is complete.
        assert lines[0] == "READY=1"
        assert any(line.startswith("STATUS=serving") for line in lines)
        # By READY=1 the group exists (systemd starts dependants against a working worker).
        ready = [e for e in worker.log_events() if e.get("event") == "worker_ready"]
        assert ready
        # Its start-up heap (a model, a tokenizer, an engine) is out of the full collections.
        assert ready[0]["frozen_objects"] > 10_000
        # Pings every WATCHDOG_USEC / 2 = 0.5 s.
        started = time.monotonic()
        notify.wait_for("WATCHDOG=1", 5, worker)
        lines = wait_until(
            lambda: (found := notify.lines()).count("WATCHDOG=1") >= 3 and found,
            5,
            "three watchdog pings",
        )
        assert time.monotonic() - started < 3
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0
        lines = notify.lines()
        assert "STOPPING=1" in lines
        assert lines.index("READY=1") < lines.index("WATCHDOG=1") < lines.index("STOPPING=1")
    finally:
        worker.kill()
        notify.close()


@pytest.mark.timeout(120)
def test_sigterm_with_a_job_in_flight_drains_and_exits_0(
    tmp_path: Path, redis_server: RedisServer, prefix: str, tiny: str
) -> None:
    drain_timeout = 20.0
    max_tokens = 150  # a few seconds of the tiny model: still running when SIGTERM arrives
    worker = service_worker(
        tmp_path,
        tiny,
        "drained",
        prefix,
        redis_url=redis_server.url,
        flags=["--drain-timeout", str(drain_timeout)],
    )

    async def main() -> tuple[list[Event], float]:
        async with Client(redis_server.url, prefix=prefix) as client:
            rid = await client.submit("a long story", max_tokens=max_tokens, temperature=0.0)
            events: list[Event] = []
            first_delta = asyncio.Event()

            async def follow() -> None:
                async for event in client.stream(rid, timeout=60):
                    events.append(event)
                    if isinstance(event, DeltaEvent):
                        first_delta.set()

            following = asyncio.create_task(follow())
            await asyncio.wait_for(first_delta.wait(), READY_TIMEOUT)
            worker.signal(signal.SIGTERM)
            signalled = time.monotonic()
            rc = await asyncio.to_thread(worker.wait, drain_timeout + 10)
            elapsed = time.monotonic() - signalled
            assert rc == 0, worker.log_text()[-4000:]
            await asyncio.wait_for(following, 10)
            # The job ran from the model's stream (forwarded there from the default one).
            stream = client.keys.model_stream(MODEL)
            pending = await client.redis.xpending(stream.stream, stream.group)
            assert pending["pending"] == 0  # acknowledged: nobody runs it again
            return events, elapsed

    try:
        worker.wait_ready()
        events, elapsed = asyncio.run(main())
    finally:
        worker.kill()
    assert elapsed < drain_timeout
    stopping = [e for e in worker.log_events() if e.get("event") == "worker_stopping"]
    assert stopping and stopping[0]["in_flight"] == 1  # the job was running at SIGTERM
    done = events[-1]
    assert isinstance(done, DoneEvent), done
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens == max_tokens


# One model's series carry its label.
LABEL = f'model="{MODEL}"'

# Every family the issue names, as exposition sample names.
METRIC_SAMPLES = (
    f"mlxw_requests_in_flight{{{LABEL}}}",
    f'mlxw_jobs_total{{{LABEL},outcome="completed"}}',
    f"mlxw_tokens_generated_total{{{LABEL}}}",
    f"mlxw_ttft_seconds_count{{{LABEL}}}",
    "mlxw_ttft_seconds_bucket",
    f"mlxw_job_duration_seconds_count{{{LABEL}}}",
    f"mlxw_group_lag{{{LABEL}}}",
    f"mlxw_group_pending{{{LABEL}}}",
    f"mlxw_engine_steps_total{{{LABEL}}}",
    f"mlxw_engine_thread_cpu_seconds_total{{{LABEL}}}",
    f"mlxw_engine_step_seconds_total{{{LABEL}}}",
    f"mlxw_engine_model_seconds_total{{{LABEL}}}",
    f"mlxw_prefix_cache_hit_rate{{{LABEL}}}",
    "mlxw_redis_round_trips_total",
    'mlxw_gc_collections_total{generation="0"}',
    'mlxw_gc_pause_longest_seconds{generation="2"}',
)


@pytest.mark.timeout(120)
def test_metrics_endpoint_after_a_job(
    tmp_path: Path, redis_server: RedisServer, prefix: str, tiny: str
) -> None:
    # The URL comes from a file, as under launchd and systemd.
    url_file = tmp_path / "redis-url"
    url_file.write_text(redis_server.url + "\n")
    url_file.chmod(0o600)
    port = free_port()
    worker = service_worker(
        tmp_path,
        tiny,
        "measured",
        prefix,
        flags=["--metrics-port", str(port)],
        env={"MLXW_REDIS_URL_FILE": str(url_file)},
    )

    async def one_job() -> DoneEvent:
        async with Client(redis_server.url, prefix=prefix) as client:
            done = await client.generate(
                "count to three", max_tokens=8, temperature=0.0, timeout=60
            )
        assert isinstance(done, DoneEvent), done
        return done

    try:
        worker.wait_ready()
        before = scrape(port)
        # Nothing observed yet (a labelled histogram shows no sample before its first one).
        assert before.get(f"mlxw_ttft_seconds_count{{{LABEL}}}", 0) == 0
        done = asyncio.run(one_job())

        def refreshed() -> dict[str, Any] | None:
            samples = scrape(port)
            completed = samples.get(f'mlxw_jobs_total{{{LABEL},outcome="completed"}}')
            return samples if completed == 1 else None

        samples = wait_until(refreshed, 10, "the completed job in the metrics")
    finally:
        worker.kill()
    present = {name.split("{")[0] for name in samples if name is not None}
    for name in METRIC_SAMPLES:
        assert name in samples or name in present, f"{name} missing from /metrics"

    def sample(name: str) -> Any:
        return samples[f"{name}{{{LABEL}}}"]

    assert sample("mlxw_requests_in_flight") == 0
    assert sample("mlxw_tokens_generated_total") >= done.usage.completion_tokens == 8
    assert sample("mlxw_ttft_seconds_count") == 1
    assert sample("mlxw_job_duration_seconds_count") == 1
    assert sample("mlxw_engine_steps_total") >= 8
    assert sample("mlxw_engine_thread_cpu_seconds_total") > 0
    assert samples["mlxw_redis_round_trips_total"] >= 1
    # A served job allocates enough for young collections, each timed.
    assert samples['mlxw_gc_collections_total{generation="0"}'] > 0
    assert samples['mlxw_gc_pause_seconds_total{generation="0"}'] > 0
    assert sample("mlxw_group_pending") == 0
    assert sample("mlxw_group_lag") == 0
    assert 0 <= sample("mlxw_prefix_cache_hit_rate") <= 1
