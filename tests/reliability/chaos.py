"""Chaos run: producers, workers SIGKILLed and restarted all along, one Redis restart.

    python -m tests.reliability.chaos --jobs 1000 --workers 3 --producers 3

Several producer processes submit N greedy jobs (plus a few invalid entries) at a steady rate
and follow every request to its end; 3-4 worker processes serve them from one redis-server
with AOF on (``appendfsync always``), started here on a free port. A killer SIGKILLs a random
worker every few seconds and restarts it under the same worker id; Redis itself is restarted
once, half-way through the submissions. Then every request's replay log is read with XRANGE
and checked event by event, every subscriber's merged stream is compared with it, and every
greedy text with a direct engine run of the same prompt.
"""

from __future__ import annotations

# `mlx_redis_worker` must be imported before anything imports mlx: it loads OpenBLAS first.
import mlx_redis_worker  # noqa: F401  # isort: skip

import base64
import json
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import redis

from mlx_redis_protocol.codec_job import decode_job, encode_job
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import DoneEvent, ErrorEvent, Job
from mlx_redis_worker.local_redis import RedisServer
from tests.reliability.streams import (
    check_log,
    dead_letters,
    read_log_entries,
    stray_dead_letters,
    wait_settled,
)
from tests.reliability.workers import ONE_BLAS_THREAD, start_workers
from tests.support.drivers import (
    DriverResult,
    config_from_arguments,
    exit_with,
    percentile,
    report,
    work_directory,
)
from tests.support.processes import WorkerProcess
from tests.support.prompts import random_prompts
from tests.support.references import tiny_reference

AOF = ("--appendonly", "yes", "--appendfsync", "always")


@dataclass
class ChaosConfig:
    jobs: int = 1000
    workers: int = 3
    producers: int = 3
    max_tokens: int = 16
    prompts: int = 64  # distinct prompts, reused round-robin (the prefix cache gets hits)
    invalid_share: float = 0.02
    rate: float = 10.0  # jobs per second, all producers together
    kill_every: float = 4.0  # mean seconds between two SIGKILLs
    redis_restart: bool = True
    redis_down: float = 2.0  # seconds Redis stays down: past the lease, so jobs get reclaimed
    max_concurrency: int = 8
    lease_seconds: float = 2.0
    max_deliveries: int = 10
    seed: int = 1
    event_timeout: float = 60.0
    give_up_after: float = 900.0
    directory: Path | None = None


@dataclass
class _Spec:
    rid: str
    data: bytes
    valid: bool
    prompt: str | None = None
    expect_code: str | None = None  # the decoder's verdict for an invalid entry
    readable: bool = False  # whether the worker can name the request in an error event


def build_specs(config: ChaosConfig, pool: list[str]) -> list[_Spec]:
    rng = random.Random(config.seed)
    specs = []
    invalid_every = round(1 / config.invalid_share) if config.invalid_share > 0 else 0
    valid_index = 0
    for index in range(config.jobs + (config.jobs // invalid_every if invalid_every else 0)):
        rid = f"chaos-{index:05d}"
        if invalid_every and index % invalid_every == invalid_every - 1:
            specs.append(_invalid(rid, rng))
            continue
        prompt = pool[valid_index % len(pool)]
        valid_index += 1
        job = Job(
            request_id=rid,
            prompt=prompt,
            max_tokens=config.max_tokens,
            temperature=0.0,
            metadata={"index": index},
        )
        specs.append(_Spec(rid, encode_job(job), True, prompt=prompt))
    return specs


def _invalid(rid: str, rng: random.Random) -> _Spec:
    kind = rng.choice(["max_tokens", "garbage", "version", "no_prompt"])
    if kind == "max_tokens":
        data = msgpack.packb({"v": 1, "request_id": rid, "prompt": "x", "max_tokens": 0})
    elif kind == "garbage":
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))
    elif kind == "version":
        data = msgpack.packb({"v": 2, "request_id": rid, "prompt": "x"})
    else:
        data = msgpack.packb({"v": 1, "request_id": rid, "max_tokens": 4})
    try:
        decode_job(data)
    except ProtocolError as exc:
        return _Spec(rid, data, False, expect_code=exc.code, readable=exc.request_id == rid)
    raise AssertionError(f"the invalid entry {data!r} decodes")


class _Killer(threading.Thread):
    """SIGKILLs a random worker every ``every`` seconds (±40 %) and restarts it at once."""

    def __init__(self, workers: list[WorkerProcess], every: float, seed: int) -> None:
        super().__init__(name="killer", daemon=True)
        self.workers = workers
        self.every = every
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.kills = 0

    def run(self) -> None:
        while not self.stop.wait(self.every * self.rng.uniform(0.6, 1.4)):
            victim = self.rng.choice(self.workers)
            victim.kill()
            self.kills += 1
            victim.start()


def run_chaos(config: ChaosConfig) -> DriverResult:
    directory = work_directory(config.directory, "chaos")
    prefix = "chaos"
    keys = Keys(prefix)
    pool = random_prompts(config.prompts, seed=config.seed)
    specs = build_specs(config, pool)
    references = tiny_reference().by_prompt(pool, config.max_tokens)

    server = RedisServer(extra_args=AOF, directory=directory / "redis")
    server.start()
    workers: list[WorkerProcess] = []
    producers: list[subprocess.Popen[bytes]] = []
    killer: _Killer | None = None
    try:
        workers = start_workers(
            config.workers,
            server.url,
            prefix,
            directory,
            max_concurrency=config.max_concurrency,
            lease_seconds=config.lease_seconds,
            flags=("--max-deliveries", str(config.max_deliveries)),
            env=ONE_BLAS_THREAD,
        )
        started = time.monotonic()
        killer = _Killer(workers, config.kill_every, config.seed)
        killer.start()
        producers, outputs = _start_producers(config, specs, server.url, prefix, directory)
        restart_downtime = None
        if config.redis_restart:
            restart_downtime = _restart_redis_midway(server, config, producers)
        for producer in producers:
            producer.wait(timeout=config.give_up_after + 60)
        killer.stop.set()
        killer.join()
        elapsed = time.monotonic() - started
        client = redis.Redis.from_url(server.url, socket_timeout=10)
        settled = wait_settled(client, keys, timeout=60)
        for worker_process in workers:  # one restarted a moment ago must serve before SIGTERM
            worker_process.wait_ready()
        stop_codes = [worker_process.stop() for worker_process in workers]
        followed = _read_outputs(outputs)
        result = _verify(config, specs, references, client, keys, followed)
        client.close()
    finally:
        if killer is not None:
            killer.stop.set()
        for producer in producers:
            if producer.poll() is None:
                producer.kill()
        for worker_process in workers:
            worker_process.kill()
        server.stop()

    values = result.values
    latencies = values.pop("latencies")
    result.problems += [] if settled else ["jobs still queued or pending at the end"]
    result.problems += [
        f"worker {w.worker_id} did not stop cleanly (rc={rc})"
        for w, rc in zip(workers, stop_codes, strict=True)
        if rc != 0
    ]
    values.update(
        kills=killer.kills,
        restarts=sum(w.starts - 1 for w in workers),
        elapsed=elapsed,
        p50=percentile(latencies, 50),
        p99=percentile(latencies, 99),
        throughput=values["done"] / elapsed if elapsed else 0.0,
        redis_downtime=restart_downtime,
    )
    result.figures = [
        ("valid jobs", config.jobs),
        ("invalid entries mixed in", len(specs) - config.jobs),
        ("producers / workers", f"{config.producers} / {config.workers}"),
        ("max_tokens (greedy, tiny model)", config.max_tokens),
        ("SIGKILLs (each worker restarted at once)", values["kills"]),
        (
            "Redis restarts (AOF, appendfsync always)",
            f"1 (down {restart_downtime:.1f} s)" if restart_downtime is not None else 0,
        ),
        ("redeliveries (reset events)", values["redeliveries"]),
        ("jobs with more than one attempt", values["multi_attempt"]),
        ("done", values["done"]),
        ("valid jobs dead-lettered (with reason)", values["valid_dead"]),
        ("invalid entries dead-lettered with the decoder's code", values["invalid_dead"]),
        ("lost", values["lost"]),
        ("duplicates delivered", values["duplicates"]),
        ("greedy texts different from a direct engine run", values["mismatches"]),
        ("subscriber reconnects", values["reconnects"]),
        ("submit retries (Redis down)", values["submit_retries"]),
        ("job latency p50 / p99 (submit to done, s)", f"{values['p50']:.2f} / {values['p99']:.2f}"),
        ("wall time (s)", round(elapsed, 1)),
        (
            f"jobs done per second (submitted at {config.rate:g}/s)",
            round(values["throughput"], 2),
        ),
    ]
    (directory / "figures.json").write_text(json.dumps(values, default=str))
    result.values["directory"] = str(directory)
    return result


def _start_producers(
    config: ChaosConfig, specs: list[_Spec], url: str, prefix: str, directory: Path
) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    processes, outputs = [], []
    for index in range(config.producers):
        share = specs[index :: config.producers]
        plan = {
            "url": url,
            "prefix": prefix,
            "rate": config.rate / config.producers,
            "event_timeout": config.event_timeout,
            "give_up_after": config.give_up_after,
            "specs": [
                {
                    "rid": spec.rid,
                    "data": base64.b64encode(spec.data).decode(),
                    "follow": spec.valid or spec.readable,
                }
                for spec in share
            ],
        }
        plan_path = directory / f"producer-{index}.plan.json"
        plan_path.write_text(json.dumps(plan))
        output = directory / f"producer-{index}.result.json"
        log = (directory / f"producer-{index}.log").open("wb")
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.reliability.producer", str(plan_path), str(output)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        log.close()
        outputs.append(output)
    return processes, outputs


def _restart_redis_midway(
    server: RedisServer, config: ChaosConfig, producers: list[subprocess.Popen[bytes]]
) -> float:
    """Restart Redis when about half the jobs have been submitted; returns its downtime."""
    midway = time.monotonic() + config.jobs / config.rate / 2
    while time.monotonic() < midway and any(p.poll() is None for p in producers):
        time.sleep(0.1)
    down = time.monotonic()
    server.stop()
    time.sleep(config.redis_down)
    server.start()
    return time.monotonic() - down


def _read_outputs(outputs: list[Path]) -> dict[str, dict[str, Any]]:
    followed: dict[str, dict[str, Any]] = {}
    for path in outputs:
        if path.exists():
            for row in json.loads(path.read_text()):
                followed[row["rid"]] = row
    return followed


def _verify(
    config: ChaosConfig,
    specs: list[_Spec],
    references: dict[str, str],
    client: redis.Redis,
    keys: Keys,
    followed: dict[str, dict[str, Any]],
) -> DriverResult:
    problems: list[str] = stray_dead_letters(client, keys)
    dead = dead_letters(client, keys)
    dead_by_rid = {row["request_id"].decode(): row for row in dead if "request_id" in row}
    dead_by_job = {row["job"]: row for row in dead}
    counts = dict.fromkeys(
        (
            "done",
            "valid_dead",
            "invalid_dead",
            "lost",
            "duplicates",
            "mismatches",
            "redeliveries",
            "multi_attempt",
            "reconnects",
            "submit_retries",
        ),
        0,
    )
    latencies: list[float] = []
    for spec in specs:
        seen = followed.get(spec.rid)
        if seen is None:
            problems.append(f"{spec.rid}: no producer result")
            continue
        counts["submit_retries"] += seen["submit_failures"]
        if not spec.valid and not spec.readable:
            row = dead_by_job.get(spec.data)
            if row is None:
                problems.append(f"{spec.rid}: unreadable invalid entry not dead-lettered")
            elif row["code"].decode() != spec.expect_code or not row["message"]:
                problems.append(f"{spec.rid}: dead-letter code {row['code']!r}")
            else:
                counts["invalid_dead"] += 1
            continue
        log = check_log(spec.rid, read_log_entries(client, keys, spec.rid))
        problems += [f"{spec.rid}: {p}" for p in log.problems]
        counts["duplicates"] += max(0, log.terminals - 1) + log.repeated_seqs
        counts["redeliveries"] += log.resets
        counts["multi_attempt"] += len(log.attempts) > 1
        problems += [f"{spec.rid}: {p}" for p in _check_subscriber(seen, log.seqs, log.final_text)]
        counts["duplicates"] += seen.get("duplicates", 0)
        counts["reconnects"] += seen.get("reconnects", 0)
        terminal = log.terminal
        if terminal is None:
            counts["lost"] += 1
            problems.append(f"{spec.rid}: lost (no terminal event)")
            continue
        if not spec.valid:
            row = dead_by_rid.get(spec.rid)
            if not (isinstance(terminal, ErrorEvent) and terminal.code == "invalid_job"):
                problems.append(f"{spec.rid}: invalid entry ended with {terminal}")
            elif row is None or row["code"].decode() != spec.expect_code:
                problems.append(f"{spec.rid}: invalid entry not dead-lettered with its code")
            else:
                counts["invalid_dead"] += 1
            continue
        if isinstance(terminal, ErrorEvent):
            row = dead_by_rid.get(spec.rid)
            if terminal.code == "dead_lettered" and row is not None and row["message"]:
                counts["valid_dead"] += 1
            else:
                problems.append(f"{spec.rid}: valid job ended with {terminal}")
            continue
        assert isinstance(terminal, DoneEvent)
        counts["done"] += 1
        want = references[spec.prompt or ""]
        if terminal.output_text != want or log.final_text != want:
            counts["mismatches"] += 1
            problems.append(f"{spec.rid}: text {terminal.output_text!r} != greedy {want!r}")
        if terminal.metadata != {"index": int(spec.rid.split("-")[1])}:
            problems.append(f"{spec.rid}: metadata {terminal.metadata!r}")
        if seen.get("ended_at") is not None:
            latencies.append(seen["ended_at"] - seen["submitted_at"])
    if counts["lost"]:
        problems.append(f"{counts['lost']} jobs lost")
    return DriverResult("Chaos run", problems=problems, values={**counts, "latencies": latencies})


def _check_subscriber(seen: dict[str, Any], log_seqs: list[int], log_text: str) -> list[str]:
    problems = []
    if seen.get("error"):
        problems.append(f"subscriber: {seen['error']}")
    seqs = seen.get("seqs", [])
    if seqs != list(range(len(seqs))):
        problems.append(f"subscriber's merged stream has a gap or a repeat: {seqs}")
    elif seqs != log_seqs:
        problems.append(f"subscriber saw seqs {seqs}, the log holds {log_seqs}")
    if seen.get("final_text") != log_text:
        problems.append("subscriber's text after the last reset differs from the log's")
    return problems


def main(argv: list[str] | None = None) -> int:
    options = (
        "jobs",
        "workers",
        "producers",
        "max_tokens",
        "rate",
        "kill_every",
        "redis_restart",
        "redis_down",
        "seed",
    )
    config = config_from_arguments(ChaosConfig(), __doc__, options, argv)
    return report(run_chaos(config), config)


if __name__ == "__main__":
    exit_with(main)
