"""The one code path every fault scenario runs: workers on any topology, the drive (submit,
follow and inject the fault, all at once), the checks of ``faults_checks`` and the table.

A scenario only says which Redis to start, which workers, and what fault to inject while the
jobs run (an async callable given the Client and the progress so far); everything else
(what counts as lost, duplicated, out of order, leaked into a log) is decided once, for all.
"""

from __future__ import annotations

# `mlx_redis_worker` must be imported before anything imports mlx: it loads OpenBLAS first.
import mlx_redis_worker  # noqa: F401  # isort: skip

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.control import count_live_workers
from mlx_redis_protocol.errors import ClientError
from mlx_redis_protocol.keys import Keys
from tests.reliability.faults_checks import JobSpec, Tally, admin_redis, verify
from tests.reliability.streams import CONNECTION_ERRORS, Followed, follow, submit_raw
from tests.support.drivers import DriverResult
from tests.support.processes import WorkerProcess

# -- the drive ----------------------------------------------------------------------------------


@dataclass
class Progress:
    """What the followers saw so far; a fault waits on it to strike at the right moment."""

    followed: int
    ended: list[float] = field(default_factory=list)  # time.time() of each terminal event
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def note_end(self) -> None:
        self.ended.append(time.time())
        self.changed.set()

    async def until_ended(self, count: int, timeout: float = 300.0) -> bool:
        deadline = time.monotonic() + timeout
        while len(self.ended) < min(count, self.followed):
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), deadline - time.monotonic())
            if time.monotonic() >= deadline:
                return False
        return True


Fault = Callable[[Client, Progress], Awaitable[dict[str, Any]]]


@dataclass
class Driven:
    followed: dict[str, Followed]
    escaped: dict[str, str]  # request id -> an exception the Client's stream let escape
    fault: dict[str, Any]
    submit_failures: int
    stats: list[dict[str, Any]]
    stats_error: str | None
    seconds: float
    # Live heartbeats when the stats command went out: a broadcast waits for that many replies.
    stats_heartbeats: int | None = None
    # After a stats reply went missing: the workers that answered a ping broadcast then (a
    # lost command, or a control channel that stays deaf).
    pinged_after_miss: list[str] | None = None


async def drive(
    url: str,
    prefix: str,
    specs: Sequence[JobSpec],
    *,
    workers: Sequence[object],
    fault: Fault | None = None,
    event_timeout: float = 60.0,
    submit_concurrency: int = 32,
) -> Driven:
    """Submit every entry concurrently through one Client, follow every readable request with
    a stream of that same Client, run ``fault`` once everything is queued, then ask the
    workers for their stats (``ctl stats``). ``workers`` is read when the stats are asked for:
    a fault may start another worker (the OOM scenario's late one), and the stats then wait for
    it too."""
    started = time.monotonic()
    progress = Progress(followed=sum(spec.rid is not None for spec in specs))
    followed: dict[str, Followed] = {}
    escaped: dict[str, str] = {}
    failures = 0
    queued = 0
    all_queued = asyncio.Event()
    gate = asyncio.Semaphore(submit_concurrency)
    async with Client(url, prefix=prefix, max_connections=256) as client:

        async def one(spec: JobSpec) -> None:
            nonlocal failures, queued
            async with gate:
                failures += await submit_raw(client, spec.data, spec.rid)
            queued += 1
            if queued == len(specs):
                all_queued.set()
            if spec.rid is None:
                return
            try:
                followed[spec.rid] = await follow(
                    client, spec.rid, event_timeout=event_timeout, give_up_after=600
                )
            except Exception as exc:  # the Client raised what follow() does not expect
                escaped[spec.rid] = f"{type(exc).__name__}: {exc}"
                followed[spec.rid] = Followed(spec.rid, error=f"stream raised {exc!r}")
            finally:
                progress.note_end()

        tasks = [asyncio.create_task(one(spec)) for spec in specs]
        await all_queued.wait()
        fault_values = await fault(client, progress) if fault is not None else {}
        await asyncio.gather(*tasks)
        stats: list[dict[str, Any]] = []
        stats_error = None
        pinged = None
        # A broadcast waits for as many replies as there are live heartbeats, and control
        # commands are pub/sub: after a failover, a worker's heartbeat can be missing until its
        # next beat lands on the promoted replica, and its subscription is being restored. The
        # figures are read once every started worker heartbeats and answers a ping again, so a
        # miss below means a worker that stays dead or deaf for 30 s.
        heartbeats = await _until_all_answer(client, len(workers), seconds=30)
        try:
            replies = await client.stats(timeout=5)
            stats = [dict(reply.result or {}) for reply in replies]
        except (ClientError, *CONNECTION_ERRORS) as exc:
            stats_error = f"{type(exc).__name__}: {exc}"
        if stats_error is None and len(stats) < (heartbeats or 0):
            with contextlib.suppress(ClientError, *CONNECTION_ERRORS):
                pinged = sorted(reply.worker_id for reply in await client.ping(timeout=5))
    seconds = time.monotonic() - started
    return Driven(
        followed, escaped, fault_values, failures, stats, stats_error, seconds, heartbeats, pinged
    )


async def _until_all_answer(client: Client, workers: int, *, seconds: float) -> int | None:
    """Wait until ``workers`` heartbeats are live and as many workers answer a ping; the
    live heartbeats at the end (None: Redis did not say)."""
    deadline = time.monotonic() + seconds
    heartbeats = None
    while time.monotonic() < deadline:
        with contextlib.suppress(ClientError, *CONNECTION_ERRORS):
            heartbeats = await count_live_workers(await client.connect(), client.keys)
            if heartbeats >= workers and len(await client.ping(timeout=1)) >= workers:
                return heartbeats
        await asyncio.sleep(0.2)
    return heartbeats


def publisher_total(stats: Sequence[Mapping[str, Any]], name: str) -> int:
    return sum(int(reply.get("publisher", {}).get(name, 0)) for reply in stats)


# -- the shared run ---------------------------------------------------------------------------


@dataclass
class Stage:
    """What a scenario hands to the shared run: where, who, what, and the fault."""

    url: str
    prefix: str
    specs: list[JobSpec]
    references: dict[str, str]
    workers: list[WorkerProcess]
    fault: Fault | None = None
    event_timeout: float = 60.0
    # Run after the verification, while the workers still serve (e.g. the CLI); its values
    # join the result's.
    after: Callable[[], dict[str, Any]] | None = None


@dataclass
class Outcome:
    result: DriverResult
    driven: Driven
    tally: Tally


def run_stage(stage: Stage, title: str, directory: Path) -> Outcome:
    """The shared run: drive, verify, stop the workers (exit 0 expected); the common rows."""
    keys = Keys(stage.prefix)
    try:
        driven = asyncio.run(
            drive(
                stage.url,
                stage.prefix,
                stage.specs,
                workers=stage.workers,
                fault=stage.fault,
                event_timeout=stage.event_timeout,
            )
        )
        admin = admin_redis(stage.url)
        try:
            tally = verify(
                admin, keys, stage.specs, driven.followed, stage.references, stage.workers
            )
        finally:
            admin.close()
    except BaseException:
        for process in stage.workers:
            process.kill()
        raise
    problems = tally.problems
    if driven.stats_error is not None:
        problems.append(f"ctl stats failed: {driven.stats_error}")
    elif len(driven.stats) != len(stage.workers):
        problems.append(_missing_stats(driven, stage.workers))
    values: dict[str, Any] = {
        **{name: value for name, value in vars(tally).items() if name not in ("logs", "problems")},
        **driven.fault,
        "submit_failures": driven.submit_failures,
        "stream_exceptions_caught": sum(f.reconnects for f in driven.followed.values()),
        "streams_rewritten": sum(f.rewrites for f in driven.followed.values()),
        "stream_exceptions_escaped": len(driven.escaped),
        "escaped": sorted(set(driven.escaped.values()))[:5],
        "publisher_redis_failures": publisher_total(driven.stats, "redis_failures"),
        "seconds": driven.seconds,
        "pids": [w.pid for w in stage.workers],
        "same_process_running": [w.running() and w.starts == 1 for w in stage.workers],
        "directory": str(directory),
    }
    if stage.after is not None:
        values.update(stage.after())
    values["exit_codes"] = [w.stop() for w in stage.workers]
    problems += [
        f"worker {w.worker_id} did not stop cleanly (rc={code})"
        for w, code in zip(stage.workers, values["exit_codes"], strict=True)
        if code != 0
    ]
    rows = [
        *tally.rows(),
        (
            "subscriber stream exceptions: caught by the follower (resumed) / escaped",
            f"{values['stream_exceptions_caught']} / {values['stream_exceptions_escaped']}",
        ),
        (
            "subscriber streams told their history was rewritten (followed again)",
            values["streams_rewritten"],
        ),
        ("submit retries (Redis failed a submit)", driven.submit_failures),
        ("workers (each stopped with SIGTERM: exit 0)", len(stage.workers)),
        ("wall time of the drive (s)", round(driven.seconds, 1)),
    ]
    (directory / "figures.json").write_text(
        json.dumps({**values, "problems": problems}, default=str, indent=1)
    )
    return Outcome(DriverResult(title, rows, problems, values), driven, tally)


def _missing_stats(driven: Driven, workers: Sequence[WorkerProcess]) -> str:
    """Which workers did not answer ``ctl stats``, with what their logs say about control
    replies and Redis failures, so that a rare miss can be told apart: a heartbeat missing
    when the command went out (the broadcast then waits for fewer replies), a lost command, or
    a reply that failed."""
    answered = {reply.get("worker_id") for reply in driven.stats}
    silent = [w for w in workers if w.worker_id not in answered]
    notes = []
    for process in silent:
        events = [
            f"{e.get('timestamp')} {e.get('event')} {e.get('operation') or e.get('kind') or ''}"
            for e in process.log_events()
            if e.get("event") in _STATS_CLUES
        ]
        notes.append(f"{process.worker_id}: {events[-4:]}")
    return (
        f"{len(driven.stats)} stats replies from {len(workers)} workers "
        f"({driven.stats_heartbeats} live heartbeats when sent; a ping then answered by "
        f"{driven.pinged_after_miss}; silent: {'; '.join(notes)})"
    )


_STATS_CLUES = frozenset(
    {"control_reply_failed", "control_command_failed", "redis_failing", "redis_recovered"}
)


def longest_pause(times: Sequence[float]) -> float:
    ordered = sorted(times)
    return max((b - a for a, b in itertools.pairwise(ordered)), default=0.0)
