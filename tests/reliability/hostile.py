"""Hostile input: thousands of generated job entries, most of them bad, mixed with valid jobs.

    python -m tests.reliability.hostile --entries 10000

Garbage bytes, msgpack that is not a map, wrong types, missing fields, huge strings, deep
nesting, negative or enormous max_tokens, unknown versions, entries without a ``job`` field,
and protocol-valid jobs with absurd sampling values, plus 5 % valid greedy jobs and a
sprinkle of hostile control messages, all queued on one worker's default stream, which
forwards every entry (as it is, garbage included) to its model's stream. The protocol's own
decoder is the oracle for each entry: what it refuses must be dead-lettered on the model's
stream with its code (and get an ``error`` event when it names a readable request id); what
it accepts must end with exactly one terminal event. The worker must survive all of it with
bounded memory, and the valid jobs must come out with the greedy text of a direct engine run.
"""

from __future__ import annotations

# `mlx_redis_worker` must be imported before anything imports mlx: it loads OpenBLAS first.
import mlx_redis_worker  # noqa: F401  # isort: skip

import asyncio
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import DoneEvent, ErrorEvent
from mlx_redis_worker.local_redis import RedisServer
from tests.reliability.hostile_entries import MIB, Entry, Generator, pack
from tests.reliability.streams import (
    check_log,
    dead_letters,
    read_log_entries,
    settled_now,
    stray_dead_letters,
)
from tests.reliability.workers import worker_process
from tests.support.drivers import (
    DriverResult,
    config_from_arguments,
    exit_with,
    percentile,
    report,
    work_directory,
)
from tests.support.events import terminal_summary
from tests.support.processes import MODEL, WorkerProcess
from tests.support.prompts import random_prompts
from tests.support.references import tiny_reference


@dataclass
class HostileConfig:
    entries: int = 10_000
    seed: int = 7
    max_tokens: int = 8
    max_concurrency: int = 8
    control_messages: int = 0  # hostile control-channel messages; default entries // 50
    batch: int = 250  # entries per XADD pipeline
    directory: Path | None = None
    timeout: float = 1800.0


class _MemorySampler(threading.Thread):
    def __init__(self, process: WorkerProcess, every: float = 0.25) -> None:
        super().__init__(name="rss", daemon=True)
        self.process = process
        self.every = every
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every):
            self.samples.append((time.monotonic(), self.process.rss()))

    @property
    def peak(self) -> int:
        return max((rss for _, rss in self.samples), default=0)

    @property
    def half_way(self) -> int:
        return self.samples[len(self.samples) // 2][1] if self.samples else 0


def run_hostile(config: HostileConfig) -> DriverResult:
    directory = work_directory(config.directory, "hostile")
    prefix = "hostile"
    keys = Keys(prefix)
    pool = random_prompts(32, seed=config.seed)
    generator = Generator(config.seed, pool, config.max_tokens)
    entries = [generator.make(index) for index in range(config.entries)]
    references = tiny_reference().by_prompt(pool, config.max_tokens)

    server = RedisServer(directory=directory / "redis")
    server.start()
    process = worker_process(
        "hostile-1", server.url, prefix, directory, max_concurrency=config.max_concurrency
    )
    sampler = _MemorySampler(process)
    try:
        process.start().wait_ready()
        rss_ready = process.rss()
        warm = asyncio.run(_warm_up(server.url, prefix, pool, config.max_tokens))
        rss_warm = process.rss()
        sampler.start()
        started = time.monotonic()
        controls = config.control_messages or config.entries // 50
        asyncio.run(_flood(server.url, keys, entries, config.batch, controls, generator.rng))
        client = redis.Redis.from_url(server.url, socket_timeout=30)
        drained = _wait_drained(client, keys, process, config.timeout)
        elapsed = time.monotonic() - started
        sampler.stop.set()
        sampler.join()
        alive = process.running() and process.starts == 1
        ping_ok, memory = asyncio.run(_ping_and_memory(server.url, prefix, process.worker_id))
        rss_end = process.rss()
        result = _verify(entries, references, client, keys)
        redis_memory = int(client.info("memory")["used_memory"])
        client.close()
        stop_code = process.stop()
    finally:
        sampler.stop.set()
        process.kill()
        server.close()

    crashes = [
        e for e in process.log_events() if e.get("event") in ("job_task_failed", "task_failed")
    ]
    problems = result.problems
    problems += [] if drained else ["the worker did not work off the queue in time"]
    problems += [] if alive else [f"the worker died (rc={process.returncode()})"]
    problems += [] if ping_ok else ["the worker did not answer ping after the flood"]
    problems += [f"worker log: {e}" for e in crashes[:10]]
    problems += [] if stop_code == 0 else [f"the worker did not stop cleanly (rc={stop_code})"]
    values = result.values
    values.update(
        elapsed=elapsed,
        rss_ready=rss_ready,
        rss_warm=rss_warm,
        rss_peak=sampler.peak,
        rss_half_way=sampler.half_way,
        rss_end=rss_end,
        mlx_active=memory.get("mlx_active_memory_bytes"),
        mlx_peak=memory.get("mlx_peak_memory_bytes"),
        warm_latency=warm,
        crashes=len(crashes),
    )
    mib = 1 / MIB
    result.figures = [
        ("entries", config.entries),
        ("bad entries (decoder refuses)", values["bad"]),
        ("protocol-valid jobs with absurd sampling values", values["absurd"]),
        ("valid greedy jobs mixed in", values["valid"]),
        ("hostile control messages", controls),
        ("bad entries dead-lettered with the decoder's code", values["dead_ok"]),
        ("... of which got an `error` event (request id readable)", values["error_events"]),
        ("absurd jobs ended: done / engine error / refused", values["absurd_endings"]),
        ("valid jobs done with the greedy reference text", values["valid_ok"]),
        ("valid job latency p50 / p99, queued behind the flood (s)", values["valid_latency"]),
        (
            "valid job generation time p50 (first event to end): before / during the flood (s)",
            f"{warm:.2f} / {values['valid_run_p50']:.2f}",
        ),
        ("entries per second worked off", round(config.entries / elapsed, 1)),
        ("worker crashes / restarts", f"{values['crashes']} / {process.starts - 1}"),
        (
            "worker RSS ready / warm / half-way / peak / end (MiB)",
            f"{rss_ready * mib:.0f} / {rss_warm * mib:.0f} / {sampler.half_way * mib:.0f} / "
            f"{sampler.peak * mib:.0f} / {rss_end * mib:.0f}",
        ),
        (
            "Redis used memory at the end (MiB; the dead-letter stream keeps every original)",
            f"{redis_memory * mib:.0f}",
        ),
        (
            "MLX active / peak memory at the end (MiB)",
            f"{(values['mlx_active'] or 0) * mib:.0f} / {(values['mlx_peak'] or 0) * mib:.0f}",
        ),
    ]
    result.values["directory"] = str(directory)
    return result


async def _warm_up(url: str, prefix: str, pool: list[str], max_tokens: int) -> float:
    """A few valid jobs before the flood (warm-up); their median generation time."""
    async with Client(url, prefix=prefix, max_connections=64) as client:
        durations = []
        for prompt in pool[:8]:
            done = await client.generate(prompt, max_tokens=max_tokens, temperature=0.0, timeout=60)
            assert isinstance(done, DoneEvent), done
            log = await client.redis.xrange(client.keys.log(done.request_id))
            durations.append(generation_seconds(log))
    return percentile(durations, 50)


async def _flood(
    url: str,
    keys: Keys,
    entries: list[Entry],
    batch: int,
    controls: int,
    rng: random.Random,
) -> None:
    """Queue every entry in order, pipelined; a hostile control message now and then."""
    control_every = max(1, len(entries) // controls) if controls else 0
    async with Client(url, prefix=keys.prefix) as client:
        for start in range(0, len(entries), batch):
            chunk = entries[start : start + batch]
            async with client.redis.pipeline(transaction=False) as pipe:
                for entry in chunk:
                    pipe.xadd(keys.jobs, entry.fields)  # type: ignore[arg-type]
                ids = await pipe.execute()
            for entry, entry_id in zip(chunk, ids, strict=True):
                entry.entry_id = entry_id.decode()
            if control_every:
                for index in range(start, start + len(chunk)):
                    if index % control_every == 0:
                        await client.redis.publish(keys.control, _hostile_control(keys, rng))


def _hostile_control(keys: Keys, rng: random.Random) -> bytes:
    token = f"c{rng.getrandbits(32)}"
    command = rng.choice(
        [
            {"kind": "cache_save", "name": "../../outside"},
            {"kind": "cache_load", "name": "/etc"},
            {"kind": "cache_save", "name": "a/b"},
            {"kind": "nonsense"},
            {"kind": "ping", "reply_to": keys.jobs},  # must not EXPIRE the job stream
            {"kind": "ping", "reply_to": keys.model_stream(MODEL).stream},  # nor the model's
            {"kind": "ping", "reply_to": "elsewhere:list"},
            {"kind": "stats", "id": "bad id"},
            {"kind": "abort"},
            {"kind": 5},
        ]
    )
    if rng.random() < 0.2:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
    message = {"v": 1, "id": token, "reply_to": keys.reply(token), **command}
    return pack(message)


def _wait_drained(client: redis.Redis, keys: Keys, process: WorkerProcess, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.running():
        if settled_now(client, keys):
            return True
        time.sleep(0.25)
    return False


async def _ping_and_memory(url: str, prefix: str, worker_id: str) -> tuple[bool, dict[str, Any]]:
    async with Client(url, prefix=prefix) as client:
        pings = await client.ping(worker_id=worker_id, timeout=10)
        stats = await client.stats(worker_id=worker_id, timeout=30)
    result = stats[0].result or {}
    return bool(pings and pings[0].ok), dict(result.get("memory", {}))


def _verify(
    entries: list[Entry], references: dict[str, str], client: redis.Redis, keys: Keys
) -> DriverResult:
    problems: list[str] = stray_dead_letters(client, keys)
    dead = _DeadLetters(dead_letters(client, keys))
    counts: Counter[str] = Counter()
    absurd_endings: Counter[str] = Counter()
    latencies: list[float] = []
    run_times: list[float] = []
    for entry in entries:
        where = f"entry {entry.index} ({entry.kind})"
        row = dead.pop(entry.data or b"")
        if entry.code is not None:
            counts["bad"] += 1
            if row is None:
                problems.append(f"{where}: not dead-lettered ({entry.code})")
            elif row["code"].decode() != entry.code or not row["message"]:
                problems.append(f"{where}: dead-lettered as {row['code']!r}, not {entry.code}")
            elif row.get("job", b"") != (entry.data or b""):
                problems.append(f"{where}: the dead letter does not hold the original bytes")
            else:
                counts["dead_ok"] += 1
            if entry.readable:
                assert entry.rid is not None
                log = check_log(entry.rid, read_log_entries(client, keys, entry.rid), queued=False)
                terminal = log.terminal
                if log.problems:
                    problems += [f"{where}: {p}" for p in log.problems]
                elif not (
                    isinstance(terminal, ErrorEvent)
                    and terminal.code == "invalid_job"
                    and terminal.message.startswith(f"{entry.code}:")
                ):
                    problems.append(f"{where}: ended with {terminal}")
                else:
                    counts["error_events"] += 1
            continue
        counts["valid" if entry.greedy_prompt else "absurd"] += 1
        if entry.rid is None:  # valid without a request id: it must only be acknowledged
            absurd_endings["unfollowable"] += 1
            continue
        log = check_log(entry.rid, read_log_entries(client, keys, entry.rid), queued=False)
        problems += [f"{where}: {p}" for p in log.problems]
        terminal = log.terminal
        if isinstance(terminal, ErrorEvent) and terminal.code == "invalid_job":
            if row is None or row["code"] != b"invalid_field":  # a check that needs the model
                problems.append(f"{where}: refused by the engine but not dead-lettered")
        elif row is not None:
            problems.append(f"{where}: dead-lettered though it ran ({row['code']!r})")
        if entry.greedy_prompt is not None:
            want = references[entry.greedy_prompt]
            if isinstance(terminal, DoneEvent) and terminal.output_text == want:
                counts["valid_ok"] += 1
                run_times.append(generation_seconds(client.xrange(keys.log(entry.rid))))
                done_ms = int(log_terminal_id(client, keys, entry.rid).split("-")[0])
                latencies.append((done_ms - int(entry.entry_id.split("-")[0])) / 1000)
            else:
                problems.append(f"{where}: {terminal} is not the greedy text {want!r}")
        else:
            absurd_endings[terminal_summary(terminal)] += 1
    problems += [
        f"unexpected dead letter {row.get('entry_id')!r}: {row.get('code')!r}, "
        f"job {row.get('job', b'')[:64]!r}"
        for row in dead.left()
    ]
    # Hostile control commands named these as reply_to: the worker must not have touched them.
    for stream in (keys.jobs, keys.model_stream(MODEL).stream):
        if client.ttl(stream) != -1:
            problems.append(f"the job stream {stream} got a TTL ({client.ttl(stream)} s)")
    if client.exists("elsewhere:list"):
        problems.append("a control command made the worker write a key outside its prefix")
    endings = ", ".join(f"{name} {count}" for name, count in sorted(absurd_endings.items()))
    values: dict[str, Any] = dict(counts)
    for name in ("bad", "absurd", "valid", "dead_ok", "error_events", "valid_ok"):
        values.setdefault(name, 0)
    values["absurd_endings"] = endings
    values["valid_run_p50"] = percentile(run_times, 50)
    values["valid_latency"] = (
        f"{percentile(latencies, 50):.2f} / {percentile(latencies, 99):.2f}" if latencies else "-"
    )
    return DriverResult("Hostile input", problems=problems, values=values)


class _DeadLetters:
    """The model stream's dead letters, found by the job bytes they hold. A dead letter's
    ``entry_id`` is the forwarded entry's id in the model's stream, not the id the producer
    got from XADD on the default stream, so an entry is matched by its bytes: entries with
    the same bytes (an empty ``{}``, a missing ``job`` field, forwarded as an empty one) meet
    the same fate, so which of them takes which dead letter does not matter."""

    def __init__(self, rows: list[dict[str, bytes]]) -> None:
        self.by_job: dict[bytes, list[dict[str, bytes]]] = {}
        for row in rows:
            self.by_job.setdefault(row.get("job", b""), []).append(row)

    def pop(self, job: bytes) -> dict[str, bytes] | None:
        rows = self.by_job.get(job)
        return rows.pop(0) if rows else None

    def left(self) -> list[dict[str, bytes]]:
        return [row for rows in self.by_job.values() for row in rows]


def generation_seconds(log: Any) -> float:
    """From a request's first worker event to its terminal event (log entry ids: Redis'
    clock): the time the worker spent generating, without the wait in the queue (which
    ``usage.duration_ms`` includes, counting from the job's arrival)."""
    stamps = [int(entry_id.split(b"-")[0]) for entry_id, fields in log if fields[b"seq"] != b"0"]
    return (stamps[-1] - stamps[0]) / 1000


def log_terminal_id(client: redis.Redis, keys: Keys, request_id: str) -> str:
    """The stream id (Redis clock, ms) of the request's last log entry."""
    newest = client.xrevrange(keys.log(request_id), "+", "-", count=1)
    return str(newest[0][0].decode())


def main(argv: list[str] | None = None) -> int:
    config = config_from_arguments(HostileConfig(), __doc__, ("entries", "seed"), argv)
    return report(run_hostile(config), config)


if __name__ == "__main__":
    exit_with(main)
